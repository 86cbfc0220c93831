"""How a request's tokens reach its sink and how it ends: `emit_token` and `finish`, the one
way a request ends (docs/architecture.md §Loop). A part of `Engine` (engine/engine.py), apart
so that the loop reads on its own; it reads only the engine parts named below.
"""

from __future__ import annotations

from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.request import FINISH_REASON, Event, Request, RequestOutput, TokenLogprob
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling.grammars import Grammars
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stepper import Stepper
from pdserve.kvcache.lease import Lease
from pdserve.runtime.timing import Clock


class RequestEnds:
    """`Engine`'s token and end verbs, over the engine's own parts."""

    scheduler: Scheduler
    runner: ModelRunner
    stepper: Stepper
    metrics: EngineMetrics
    grammars: Grammars
    clock: Clock
    max_model_len: int
    _generated: int  # tokens emitted since the step's metrics last counted them

    def emit_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> None:
        """A token was sampled for `req`: record it, stream it, stop if it ends the request.
        A request that asked for no token (max_tokens 0: it scores its prompt) ends here
        without it. A constrained request's matcher takes the token (D's first one, from P,
        included), and the end-of-sequence token that ends its grammar stops it. `now`: when
        it arrived (the engine clock's monotonic reading)."""
        if req.params.max_tokens == 0:
            self.finish(req, Event.LENGTH)
            return
        ended = req.constrained and self.grammars.accept(req, tok)  # raises if refused
        req.output_ids.append(tok)
        self._generated += 1  # counted into metrics once a step (a lock per inc)
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrival)
        elif req.last_token_at is not None:
            self.metrics.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        event = Event.STOP if ended else self._stop_event(req, tok)
        if event is not None:  # the last token carries the finish reason, as in vLLM
            self.finish(req, event, last=(tok, lp))
            return
        req.sink(
            RequestOutput(
                req.request_id,
                (tok,),
                (lp,) if lp is not None else (),
                num_prompt_tokens=len(req.prompt_ids),
                prompt_logprobs=req.take_prompt_logprobs(),
            )
        )

    def streams_early(self, req: Request, tok: int) -> bool:
        """Whether `req`'s first token `tok`, sampled by a peer, may be streamed before the
        request decodes here (engine/role.py StreamFirst): it cannot end the request (by any
        stop token, min_tokens aside, or by length), and the request needs nothing that comes
        only with its KV (its prompt's logprobs, which go out with the first token; a grammar's
        matcher, which takes the token once compiled)."""
        p = req.params
        return (
            not req.constrained
            and p.prompt_logprobs is None
            and p.max_tokens > 1
            and len(req.prompt_ids) + 1 < self.max_model_len
            and tok not in p.stop_token_ids
            and (p.ignore_eos or tok not in req.eos_token_ids)
        )

    def _stop_event(self, req: Request, tok: int) -> Event | None:
        p = req.params
        if len(req.output_ids) >= p.min_tokens and (
            tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_token_ids)
        ):
            return Event.STOP
        num_tokens = len(req.prompt_ids) + len(req.output_ids)  # not a token still in flight
        if len(req.output_ids) >= p.max_tokens or num_tokens >= self.max_model_len:
            return Event.LENGTH
        return None

    def finish(
        self,
        req: Request,
        event: Event,
        error: str | None = None,
        *,
        last: tuple[int, TokenLogprob | None] | None = None,
        keep_pages_for: str | None = None,
    ) -> Lease | None:
        """The one way a request ends: `event` (STOP, LENGTH, ABORT or FAIL) is its reason.
        Its sink hears once, with `last` (a final token) if given. A scheduled request leaves
        the scheduler, whose lease on its pages is released, or handed to `keep_pages_for` and
        returned (the prefill role keeps pages its writes still read). A request outside the
        scheduler (waiting for pages or for its prefill leg) holds no lease of its own: its
        room's lease is the room's to release. A finished request is left as it is."""
        if req.status.finished:
            return None
        lease = None
        self.runner.release(req)  # its page-table row (attention/page_table.py)
        step = self.stepper.computing(req)
        if self.scheduler.get(req.request_id) is not req:
            req.transition(event)
        elif keep_pages_for is not None:
            lease = self.scheduler.hand_over(req, event, keep_pages_for)
        elif step is not None:  # its pages outlive the step (engine/inflight.py)
            kept = self.scheduler.hand_over(req, event, f"step:{req.request_id}")
            if kept is not None:
                step.retire.append(kept)
        else:
            self.scheduler.finish(req, event)
        if error is not None:
            req.error = error
        reason = FINISH_REASON[req.status]
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(self.clock.monotonic() - req.arrival)
        tok, lp = last if last is not None else (None, None)
        req.sink(
            RequestOutput(
                req.request_id,
                (tok,) if tok is not None else (),
                (lp,) if lp is not None else (),
                reason,
                req.error,
                len(req.prompt_ids),
                req.take_prompt_logprobs(),
            )
        )
        return lease
