"""The engine as its role's host: what a role reads of it (engine/role.py `RoleHost`) and the
effects a role asks for, applied (`apply_effects`). A part of `Engine` (engine/engine.py), apart
like `RequestEnds` so that the loop reads on its own; it reads only the engine parts named below.

The engine applies a role's effects in the order asked, right after the verb that asked returns
(each call of a role verb in the loop and the stepper is followed by `apply_effects`), so a role
never sees a state that the effects it asked for have not reached yet. What applying one makes
the role ask in turn (`kept` applying COMPUTED; a room failing with its request) is applied in
the same call. An effect that raises costs only its request: the role's `fail` (a prefill room
fails, its pages kept until its writes end), else the request ends as FAIL. No effect is lost:
should that failure handling raise too, the effects not yet applied wait at the front of
`role.effects` for the next `apply_effects` (the loop calls it even after a verb raised, and
first thing in each tick), and the error goes on to the supervisor.
"""

from __future__ import annotations

import logging

from pdserve.config import EngineConfig
from pdserve.engine.grammar_waits import GrammarWaits
from pdserve.engine.request import Event, Request, TokenLogprob
from pdserve.engine.request_end import RequestEnds
from pdserve.engine.role import (
    Adopt,
    ComputePrompt,
    Effect,
    Finish,
    KeepPages,
    Role,
    StreamFirst,
)
from pdserve.kvcache.lease import Lease, Leases

log = logging.getLogger(__name__)


class RoleHosting(RequestEnds):
    """`Engine`'s side of its role, over the engine's own parts and its request ends."""

    cfg: EngineConfig
    role: Role
    leases: Leases
    grammar_waits: GrammarWaits

    # -- what a role reads (engine/role.py RoleHost) -------------------------------------------
    @property
    def request_timeout_s(self) -> float:
        return self.cfg.request_timeout_s

    def open_lease(self, owner: str, num_pages: int) -> Lease:
        """`num_pages` pages for `owner`, in the pool part with the most to give (data-parallel
        attention: the rank its request will run on); PageAllocError if none has them."""
        part = self.leases.allocator.roomiest(num_pages)
        lease = self.leases.open(owner, num_pages, 0 if part is None else part)
        if self.leases.slots is not None:
            try:
                lease.take_slot()
            except Exception:
                lease.release()  # nothing half taken
                raise
        return lease

    # -- what the role asks (engine/role.py effects) -----------------------------------------
    def apply_effects(self, now: float) -> None:
        """Do what the role asked, in order, right after the verb that asked returned; what
        that makes it ask next (a room failing with its request) follows. An effect that
        raises costs only its request. Should its failure handling raise as well, the effects
        still unapplied go back to the front of `role.effects`, for the next call, before the
        error goes on: none is lost (an unapplied Adopt would hold its lease forever)."""
        while effects := self.role.take_effects():
            for i, effect in enumerate(effects):
                try:
                    self._apply_one(effect, now)
                except BaseException:
                    self.role.effects[:0] = effects[i + 1 :]  # before what `effect` asked
                    raise

    def _apply_one(self, effect: Effect, now: float) -> None:
        try:
            self._apply(effect, now)
        except Exception as e:  # noqa: BLE001 - one request's failure, not the loop's
            self._effect_failed(effect, e, now)

    def _effect_failed(self, effect: Effect, e: Exception, now: float) -> None:
        """`effect` raised: its request fails, the role's way if it has one (a prefill room
        fails), else, or should the role's way raise too, as a plain FAIL. A KeepPages whose
        `kept` raised left its request finished: its room still fails (P's `fail` finds it by
        the request's id), else it would wait for its deadline holding the pages."""
        req, what = effect.req, type(effect).__name__
        log.warning("request %s: %s raised %s: %s", req.request_id, what, type(e).__name__, e)
        why = f"{effect.why_failed}: {type(e).__name__}: {e}"
        if not req.status.finished or isinstance(effect, KeepPages):
            try:
                if self.role.fail(req, why, now):
                    return
            except Exception:  # noqa: BLE001 - the request still ends, plainly
                log.exception("request %s: its role could not fail it", req.request_id)
        self.finish(req, Event.FAIL, why)  # a finished request is left as it is

    def _apply(self, effect: Effect, now: float) -> None:
        match effect:
            case ComputePrompt(req=req):
                self.scheduler.add(req)
                self.grammar_waits.hold(req)
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))  # once it is scheduled
            case Adopt(req=req, lease=lease, token=tok, logprob=lp, started=started):
                self._adopt(req, lease, tok, lp, now)
                if started is not None:
                    started(now)
            case StreamFirst(req=req, token=tok, logprob=lp):
                if not req.status.finished and not req.output_ids and self.streams_early(req, tok):
                    self.emit_token(req, tok, lp, now)
            case Finish(req=req, event=event, error=error):
                self.finish(req, event, error)
            case KeepPages(req=req, event=event, owner=owner):
                self.role.kept(req, self.finish(req, event, keep_pages_for=owner), now)

    def _adopt(
        self, req: Request, lease: Lease, tok: int, lp: TokenLogprob | None, now: float
    ) -> None:
        req.num_computed = len(req.prompt_ids)
        streamed = bool(req.output_ids)  # its StreamFirst streamed P's first token
        try:
            if streamed and req.output_ids != [tok]:
                raise ValueError(f"first token {tok} is not the {req.output_ids} streamed")
            self.scheduler.adopt(req, lease)  # the scheduler owns the lease from here
        except Exception:
            lease.release()  # never the scheduler's: it goes back, and the request fails
            raise
        if streamed:  # the client's gap to the next token includes the KV wait (D's kv_wait);
            req.last_token_at = now  # the engine's ITL counts decode pace from here
            return
        if not self.grammar_waits.hold(req, (tok, lp, now)):  # else taken once it compiled
            self._take_first_token(req, tok, lp, now)

    def took_token(self, req: Request, now: float) -> None:
        """The role took `req`'s sampled token (P's first): counted as generated, its time to
        first token observed (P's own: its queue and the prompt), then what the role asked
        done (P's room leaves the batch)."""
        self._generated += 1  # counted into metrics once a step, with the engine's own
        self.metrics.ttft.observe(now - req.arrival)
        self.apply_effects(now)

    def _take_first_token(
        self, req: Request, tok: int, lp: TokenLogprob | None, now: float
    ) -> None:
        """D's first token, sampled by P: emitted like any other (its grammar takes it)."""
        try:
            self.emit_token(req, tok, lp, now)
        except Exception as e:  # noqa: BLE001 - e.g. its grammar refuses P's token: it alone fails
            log.warning("request %s: its first token %d was refused: %s", req.request_id, tok, e)
            self.finish(req, Event.FAIL, f"its first token could not be taken: {e}")
