"""The step: schedule, launch on the device, then process the sampled tokens, plain or overlapped.

`Stepper.step` is the engine loop's forward, sample and emit (docs/architecture.md §Loop):

    plan = schedule -> launch(plan) [forward, after_forward, sampler.launch]
         -> complete the step before (overlapped) or this one (plain): its tokens, its pages

With overlapped scheduling (engine/inflight.py: why it is exact) the step launched here is
completed by the next call, while the device runs the one after it. The stepper keeps the step
in flight and the one being launched; everything else (the scheduler, the runner, the role,
`finish`) is its host's, the Engine, reached through `StepHost` so that this module imports
nothing of engine.py. A failure inside a step fails only its requests (engine/isolation.py),
but a tensor-parallel group out of step (`LockstepError`, engine/tp_leader.py) is no request's
fault: it leaves the step at once, for the engine to end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from pdserve.engine.inflight import InFlight, Picks
from pdserve.engine.isolation import forward_each, sample_each
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.request import Event, Request, TokenLogprob
from pdserve.engine.role import Role
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, StepPlan
from pdserve.kvcache.pool import KVPool
from pdserve.parallel.lockstep import LockstepError
from pdserve.runtime.timing import Clock

log = logging.getLogger(__name__)


class StepHost(Protocol):
    """What a step needs of the engine (engine/engine.py)."""

    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    metrics: EngineMetrics
    pool: KVPool
    role: Role
    overlap: bool
    max_model_len: int

    clock: Clock

    def emit_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> None: ...

    def finish(self, req: Request, event: Event, error: str | None = None) -> object: ...

    def apply_effects(self, now: float) -> None:
        """What the role asked in the verb just called (engine/role_host.py)."""

    def took_token(self, req: Request, now: float) -> None:
        """The role took `req`'s sampled token: counted, and what it asked applied."""

    def while_waiting(self, in_step: Callable[[Request], bool]) -> None:
        """While the thread waits for a step on the device: the role's `while_waiting`, and
        what it sent. `in_step(req)`: whether that step computes `req`."""


class Stepper:
    def __init__(self, host: StepHost) -> None:
        self.host = host
        # The step in flight, if any, and the one being launched; requests ending meanwhile
        # keep their pages until theirs completed (InFlight.retire).
        self._inflight: InFlight | None = None
        self._launching: InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def step(self) -> StepPlan:
        """Schedule and launch a step; then process the outputs of the step before it (with
        overlap) or of this one (without). Returns the plan."""
        h = self.host
        plan = h.scheduler.schedule()
        launched = None
        if plan.chunks:
            launched = self._launching = InFlight(list(plan.chunks))
            try:
                self._launch(plan, launched)
            except LockstepError:
                raise  # the group's end, not the step's: the engine ends (Engine._ranks_lost)
            except Exception as e:  # noqa: BLE001 - a bug past the isolation: fail the step
                h.metrics.step_errors.inc()
                log.exception("engine step failed; failing %d requests", len(plan.chunks))
                for c in plan.chunks:
                    self.fail(c.request, f"engine step failed: {type(e).__name__}: {e}")
            launched.launched(h.pool.device)
        self.complete()  # the step before: requests it ends keep pages for `launched`
        self._launching = None
        self._inflight = launched
        if launched is not None and not (h.overlap and h.role.overlaps):
            self.complete()
        return plan

    def _launch(self, plan: StepPlan, step: InFlight) -> None:
        """Forward and sample `plan` on the device, nothing waiting for the results; the
        tokens become pending on their requests."""
        h = self.host
        chunks = step.chunks
        feed = self._inflight.feed() if self._inflight is not None else None
        try:
            logits = h.runner.forward(chunks, feed)
        except LockstepError:
            raise  # every rank ran this step's record: none may run its chunks again
        except Exception as e:  # noqa: BLE001 - find the chunk at fault, run the others
            h.metrics.step_errors.inc()
            log.warning(
                "forward failed (%s: %s); running its chunks one by one", type(e).__name__, e
            )
            logits, chunks = forward_each(h.runner, chunks, self.fail, feed)
        for c in chunks:
            c.request.num_computed = c.start + c.length
        now = h.clock.monotonic()
        h.role.after_forward(plan, now)
        h.apply_effects(now)
        # One row of `logits` each; a request that ends meanwhile keeps its row, and its
        # token is dropped when the step completes.
        sampling = [c.request for c in chunks if c.samples]
        if not sampling:
            return
        if self._inflight is not None and any(r.constrained and r.pending for r in sampling):
            # A grammar's mask needs the token in flight: its step completes first (the
            # forward just launched still overlaps it).
            self.complete()
        try:
            step.sampled = h.sampler.launch(logits, sampling)
        except Exception as e:  # noqa: BLE001 - find the row at fault, sample the others
            h.metrics.step_errors.inc()
            log.warning("sampling failed (%s: %s); sampling row by row", type(e).__name__, e)
            self.complete()  # its tokens come first
            self._emit(sample_each(h.sampler.sample, logits, sampling, self.fail))
            return
        step.sampling = sampling
        max_len = h.max_model_len
        for req in sampling:
            req.launch_token(max_len)

    def complete(self) -> None:
        """Process the step in flight, if any: its tokens, then its retired pages."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        h = self.host
        meanwhile = (lambda: h.while_waiting(step.computes)) if h.role.works_while_waiting else None
        try:
            picks = step.picks(meanwhile)
        except Exception as e:  # noqa: BLE001 - its draws are lost: their requests fail
            h.metrics.step_errors.inc()
            log.exception("a step's sampled tokens could not be read")
            picks = []
            for req in step.sampling:
                req.pending -= 1
                self.fail(req, f"its tokens were lost: {type(e).__name__}: {e}")
        for req, _, _ in picks:
            req.pending -= 1  # 2 while the step after this one is being launched
            req.pending_last = req.pending_last and req.pending > 0
        self._emit(picks)
        step.wait(meanwhile)  # a step that sampled nothing (a prompt's chunk) waits here
        for lease in step.retire:
            lease.release()

    def _emit(self, picks: Picks) -> None:
        """Each token to its request: the role's if it takes it, else streamed, all of them
        stamped with one clock reading (they arrived together)."""
        h = self.host
        take_token = h.role.take_token if h.role.takes_tokens else None
        emit_token = h.emit_token
        now = h.clock.monotonic()
        for req, tok, lp in picks:
            if req.status.finished:  # ended meanwhile (an abort, a stop, a failed write)
                continue
            try:
                if take_token is not None and take_token(req, tok, lp, now):
                    h.took_token(req, now)
                else:
                    emit_token(req, tok, lp, now)
            except Exception as e:  # noqa: BLE001 - a bug handling one token costs its request
                log.exception("handling a token of %s failed", req.request_id)
                self.fail(req, f"handling its token failed: {type(e).__name__}: {e}")

    def fail(self, req: Request, why: str) -> None:
        """A step failed `req` (only it): the role's to handle, else it ends as FAIL. What the
        role asked before (a verb of its that raised) is applied first."""
        h = self.host
        now = h.clock.monotonic()
        h.apply_effects(now)
        if not req.status.finished and not h.role.fail(req, why, now):
            h.finish(req, Event.FAIL, why)
        h.apply_effects(now)

    def computing(self, req: Request) -> InFlight | None:
        """The latest launched step that computes `req`, if it may still be running."""
        for step in (self._launching, self._inflight):
            if step is not None and step.computes(req):
                return step
        return None
