"""The scheduler: which requests run this step, how many of their tokens, and in which pages.

Sans-I/O and engine-thread-only. One step spends a token budget: running requests first
(decodes cost one token, unfinished prefills continue in chunks), then new requests from the
waiting queue. When a running request needs a page and none is free, the most recently
admitted request is preempted by recompute: its pages are freed and it waits again at the
front of the queue, keeping the tokens it generated. A *pinned* request (its pages are being
read by a KV transfer still in flight) is never preempted; if only pinned requests could give
way, the request that needs a page waits a step instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Event, Request
from pdserve.kvcache.allocator import PageAllocator


@dataclass(frozen=True)
class Chunk:
    """`length` tokens of `request` starting at position `start` are computed this step."""

    request: Request
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens: sample the next one."""
        return self.start + self.length == self.request.num_tokens


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator, page_size: int) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.page_size = page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pinned: Callable[[Request], bool] = lambda _req: False

    # -- verbs -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def adopt(self, req: Request) -> None:
        """Add a request whose prompt KV is already in its pages (computed elsewhere)."""
        req.transition(Event.SCHEDULE)
        self.running.append(req)

    def get(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def finish(self, req: Request, event: Event) -> None:
        """Move `req` to a finished state and release its pages (exactly once)."""
        req.transition(event)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed, budget)
            if not self._reserve(req, n, plan):
                if i < len(self.running) and self.running[i] is req:
                    i += 1  # no page for it this step: only pinned requests could give way
                continue  # else req itself was preempted; running[i] is now the next one
            plan.chunks.append(Chunk(req, req.num_computed, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            need = self._pages_for(req.num_computed + n) - len(req.pages)
            if not self.allocator.can_allocate(need):
                break  # no preemption to admit new work
            self.waiting.popleft()
            req.pages += self.allocator.allocate(need, req.request_id)
            req.transition(Event.SCHEDULE)
            self.running.append(req)
            plan.chunks.append(Chunk(req, req.num_computed, n))
            budget -= n
        # Decodes (one token) first, then prefill chunks: the runner's layout.
        plan.chunks.sort(key=lambda c: c.length != 1)
        return plan

    def _reserve(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Give `req` pages for `n` more tokens, preempting from the tail; False if it got none."""
        need = self._pages_for(req.num_computed + n) - len(req.pages)
        while not self.allocator.can_allocate(need):
            victim = next((r for r in reversed(self.running) if not self.pinned(r)), None)
            if victim is None:
                return False
            self._preempt(victim, plan)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.allocator.allocate(need, req.request_id)
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        req.transition(Event.PREEMPT)
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def _release(self, req: Request) -> None:
        if req.pages:
            self.allocator.free(req.pages, req.request_id)
            req.pages = []

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def counts(self) -> dict[str, int]:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "pages_free": self.allocator.num_free,
            "pages_used": self.allocator.num_used,
        }
