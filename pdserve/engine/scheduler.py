"""The scheduler: which requests run this step, how many of their tokens, and in which pages.

Sans-I/O and engine-thread-only. One step spends a token budget: running requests first
(decodes cost one token, unfinished prefills continue in chunks), then new requests from the
waiting queue. When a running request needs a page and none is free, the most recently
admitted request is preempted by recompute: its pages are released and it waits again at the
front of the queue, keeping the tokens it generated. A *pinned* request (its pages are being
read by a KV transfer still in flight) is never preempted; if only pinned requests could give
way, the request that needs a page waits a step instead.

A request's pages are its lease (`req.lease`, kvcache/lease.py): opened when it is first
given pages, extended as it grows, and ended in `_release` (finish, preemption) or handed to
its caller (`hand_over`, adopt). Nothing else here takes or gives back a page. In a pool that
keeps per-request state (DeepSeek-V4, kvcache/state_pool.py) the lease also takes a state slot
when the request is admitted (admission waits while none is free), which goes with its pages.

With a prefix cache (kvcache/prefix_cache.py), a request that gets pages starts with the
longest cached prefix of its tokens shared into its lease and counted as computed (always
leaving one token to compute: its logits are sampled), and a request that leaves (finished
other than by FAIL, preempted, or handed to a prefill room) first inserts its full computed
pages. Pages only the cache holds are evicted by the allocator when its free list is short.

With a host tier (--host-cache-mb), a lookup continues past the device match into host memory:
the request starts a load of those pages (kvcache/host_loads.py) and stays in the waiting
queue, holding its pages, until the load ends; requests behind it may go first. Loaded, it
shares the pages and prefills only the rest (they enter the device cache too); failed or timed
out, it prefills from where the device match ended. A request that leaves while loading gives
its load's pages back only once the copy ended. A loading request is not running, so it is
never preempted. A request whose grammar is still compiling (`grammar_wait`) is passed over
the same way.

Data-parallel attention (`--dp N`: the pool in N parts, one per rank, kvcache/allocator.py):
a request's pages are all in one part, its rank, chosen when it first gets pages: the part of
its longest cached prefix, else the part running the fewest requests (then the one with the
most pages to give). Page checks and preemption look at its part only: a victim in another
part frees nothing it can use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Event, Request
from pdserve.kvcache.host_loads import Load, Outcome
from pdserve.kvcache.lease import Lease, Leases
from pdserve.kvcache.prefix_cache import PrefixCache


class Chunk:
    """`length` tokens of `request` starting at position `start` are computed this step;
    `samples`: the chunk reaches the end of the request's tokens, so the next one is sampled
    (fixed when the chunk is made: the request's token count does not change within a step).

    Read-only by convention. A plain slotted class, not a frozen dataclass: one is made per
    request per step, and a frozen dataclass's __init__ costs several times more."""

    __slots__ = ("request", "start", "length", "samples")

    def __init__(
        self, request: Request, start: int, length: int, samples: bool | None = None
    ) -> None:
        """`samples`: whether start + length reaches request.num_tokens, when the caller
        knows it already (the scheduler: length is all that is left); None: computed."""
        self.request = request
        self.start = start
        self.length = length
        self.samples = start + length == request.num_tokens if samples is None else samples

    def __repr__(self) -> str:
        return f"Chunk({self.request.request_id}, start={self.start}, length={self.length})"


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        leases: Leases,
        page_size: int,
        cache: PrefixCache | None = None,
        pinned: Callable[[Request], bool] = lambda _req: False,
    ) -> None:
        self.cfg = cfg
        self.leases = leases
        self.allocator = leases.allocator
        self.page_size = page_size
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pinned = pinned  # never preempted (the role's `pins`: a transfer reads its pages)
        self.loads = cache.loads if cache is not None else None
        # Request id -> (tokens looked up, tokens loaded from the host): recorded in the cache's
        # stats when it is admitted (a lookup it must repeat, lacking pages, counts then).
        self._lookups: dict[str, tuple[int, int]] = {}
        self._no_host: set[str] = set()  # its load failed: it computes those tokens

    # -- verbs -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def adopt(self, req: Request, lease: Lease) -> None:
        """Add a request whose prompt KV is already in `lease`'s pages (computed elsewhere);
        the lease is the request's from now on."""
        if req.lease is not None:
            raise ValueError(f"request {req.request_id} adopted while it holds {req.lease!r}")
        req.transition(Event.SCHEDULE)
        req.lease = lease
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
        """Move `req` to a finished state and release its pages (its lease ends here); its
        computed pages are cached first unless it failed (its KV may be partial)."""
        self._remove(req, event)
        self._release(req, cache=event is not Event.FAIL)

    def hand_over(self, req: Request, event: Event, owner: str) -> Lease | None:
        """Finish `req` but keep its pages: its lease passes to `owner` (a prefill room whose
        writes still read them), who releases it. None if it held no pages."""
        self._remove(req, event)
        if event is not Event.FAIL:
            self._cache(req)
        lease, req.lease = req.lease, None
        return lease.hand_over(owner) if lease is not None else None

    def _remove(self, req: Request, event: Event) -> None:
        req.transition(event)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.loads is not None:
            self.loads.abandon(req.request_id)  # its pages go back once the copy ended
        self._lookups.pop(req.request_id, None)
        self._no_host.discard(req.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.loads and self.loads.has_work()))

    # -- the step ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_batched_tokens
        running, chunks, ps = self.running, plan.chunks, self.page_size
        i = 0
        while i < len(running) and budget > 0:  # the hot loop: a decode batch, every step
            req = running[i]
            left = req.num_uncomputed
            n = left if left <= budget else budget
            if n == 0:  # its last token is still in flight (engine/inflight.py)
                i += 1
                continue
            start = req.num_computed
            # Room in its pages (most decode steps), else pages for it, maybe by preempting.
            if start + n > len(req.page_view) * ps and not self._reserve(req, n, plan):
                if i < len(running) and running[i] is req:
                    i += 1  # no page for it this step: only pinned requests could give way
                continue  # else req itself was preempted; running[i] is now the next one
            chunks.append(Chunk(req, start, n, n == left))
            budget -= n
            i += 1
        self._poll_loads()
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_running:
            req = self.waiting[j]
            if req.grammar_wait:
                j += 1  # its grammar is compiling (engine/grammar_waits.py); the next may go
                continue
            self._match(req)
            if self.loads is not None and self.loads.loading(req.request_id):
                j += 1  # its KV is on its way from host memory; the next may go first
                continue
            n = min(req.num_uncomputed, budget)
            need = self._pages_for(req.num_computed + n) - req.num_pages
            part = self._place(req, need)
            if part is None and req.lease is not None and self.allocator.parts > 1:
                # Its cached prefix's part is full: it computes the prefix in one with room.
                self._release(req, cache=False)
                req.num_computed = 0
                n = min(req.num_uncomputed, budget)
                need = self._pages_for(n)
                part = self._place(req, need)
            if part is None or not self._slot_for(req):
                self._release(req, cache=False)  # a waiting request holds no pages
                req.num_computed = 0
                self._lookups.pop(req.request_id, None)
                break  # no preemption to admit new work
            del self.waiting[j]
            queried, loaded = self._lookups.pop(req.request_id, (0, 0))
            if self.cache is not None and queried:
                self.cache.record(queried, req.num_computed, loaded)
            self._grow(req, need, part)
            if self.leases.slots is not None and req.lease is not None and req.lease.slot is None:
                req.lease.take_slot()  # its per-request state (DeepSeek-V4), with its pages
                req.resumes_state = req.num_computed > 0  # a cached prefix: rebuilt from it
            req.transition(Event.SCHEDULE)
            self.running.append(req)
            # (samples computed: a request preempted with its last token in flight comes
            # back with nothing to compute, n == 0, and must not sample)
            plan.chunks.append(Chunk(req, req.num_computed, n))
            budget -= n
        # Decodes (one token) first, then prefill chunks: the runner's layout.
        plan.chunks.sort(key=lambda c: c.length != 1)
        return plan

    def _reserve(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Give `req` pages for `n` more tokens, preempting from the tail; False if it got none."""
        need = self._pages_for(req.num_computed + n) - req.num_pages
        part = self._part_of(req)
        if part is None:  # running without pages (it came back with nothing to compute)
            part = self._place(req, need)
            part = self._parts_by_load()[0] if part is None else part
        while not self.allocator.can_allocate(need, part):
            # Never a request already planned this step (those before `req`): its chunk would
            # run on released pages.
            later = self.running[self.running.index(req) :]
            if self.allocator.parts > 1:  # only its own part's pages are of use to it
                later = [r for r in later if r is req or self._part_of(r) == part]
            victim = next((r for r in reversed(later) if not self.pinned(r)), None)
            if victim is None:
                return False
            self._preempt(victim, plan)
            if victim is req:
                return False
        self._grow(req, need, part)
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        req.transition(Event.PREEMPT)
        self._release(req, cache=True)
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def _slot_for(self, req: Request) -> bool:
        """Whether `req` holds or can take a per-request state slot (always, in a pool that
        keeps no state)."""
        slots = self.leases.slots
        if slots is None or (req.lease is not None and req.lease.slot is not None):
            return True
        return slots.num_free > 0

    def _grow(self, req: Request, need: int, part: int) -> None:
        if need <= 0:
            return
        if req.lease is None:
            req.lease = self.leases.open(req.request_id, need, part)
        else:
            req.lease.extend(need)

    @staticmethod
    def _part_of(req: Request) -> int | None:
        """The pool part (data-parallel rank) of `req`'s pages; None while it holds none."""
        return req.lease.part if req.lease is not None else None

    def _parts_by_load(self) -> list[int]:
        """The pool's parts, the one running the fewest requests first (then the one with
        the most pages to give): where a request without pages goes."""
        a = self.allocator
        running = [0] * a.parts
        for r in self.running:
            part = self._part_of(r)
            if part is not None:
                running[part] += 1
        return sorted(range(a.parts), key=lambda p: (running[p], -a.available(p), p))

    def _place(self, req: Request, need: int) -> int | None:
        """The part where `req` gets its `need` more pages: its lease's, else the least loaded
        with room for them; None if that part (or every part) lacks them."""
        part = self._part_of(req)
        if part is not None or self.allocator.parts == 1:
            part = 0 if part is None else part
            return part if self.allocator.can_allocate(need, part) else None
        return next(
            (p for p in self._parts_by_load() if self.allocator.can_allocate(need, p)), None
        )

    def _release(self, req: Request, cache: bool) -> None:
        """The one place a request's pages go back: finish and preemption; with `cache`, its
        computed full pages stay in the prefix cache."""
        if req.lease is not None:
            if cache:
                self._cache(req)
            req.lease.release()
            req.lease = None

    def _match(self, req: Request) -> None:
        """A request about to get pages starts from the longest cached prefix of its tokens,
        in the device cache, then (a load) in the host tier. Not for one that scores its
        prompt (every position's logits are needed), nor one holding pages or loading."""
        if self.cache is None or req.lease is not None or req.params.prompt_logprobs is not None:
            return
        if self.loads is not None and self.loads.loading(req.request_id):
            return
        tokens = req.all_ids[: req.num_tokens - 1]  # its last token is computed: it samples
        if self.allocator.parts == 1:
            pages = self.cache.match(tokens)
        else:  # the longest hit of any part's (of equal ones, the least loaded part's)
            hits = [self.cache.match(tokens, p, touch=False) for p in self._parts_by_load()]
            pages = max(hits, key=len)
            if pages:  # only the hit it takes is used, so only its pages are touched
                pages = self.cache.match(tokens, self.allocator.part_of(pages[0]))
        if pages:
            req.lease = self.leases.open(req.request_id, part=self.allocator.part_of(pages[0]))
            req.lease.share(pages)
            req.num_computed = len(pages) * self.page_size
        self._lookups[req.request_id] = (len(tokens), 0)
        if self.loads is not None and req.request_id not in self._no_host:
            room = self.allocator.num_free + self.allocator.num_evictable
            hit = self.cache.match_host(tokens, len(pages), room)
            if hit.pages and self.loads.start(req.request_id, hit.keys, hit.pages) is not None:
                self._poll_loads()  # a synchronous copy (the CPU) has ended already

    def _poll_loads(self) -> None:
        """Apply the loads that ended: share their pages or fall back to computing."""
        if self.loads is None or self.cache is None:
            return
        for load, outcome in self.loads.poll():
            req = next((r for r in self.waiting if r.request_id == load.request_id), None)
            if req is None:  # cannot be: a request that leaves abandons its load (_remove)
                if outcome is Outcome.LOADED:
                    self.loads.end(load)
                continue
            if outcome is Outcome.LOADED:
                self._loaded(req, load)
                continue
            self._no_host.add(req.request_id)
            if outcome is Outcome.FAILED:
                self.cache.stats.host_load_failures += 1
            else:
                self.cache.stats.host_load_timeouts += 1

    def _loaded(self, req: Request, load: Load) -> None:
        """The load's pages continue the request's: it shares them, and so does the cache."""
        if self.cache is None or self.loads is None:
            raise RuntimeError("a host load finished in a scheduler without a host tier")
        if req.lease is None:
            req.lease = self.leases.open(req.request_id)
        req.lease.share(load.lease.pages)
        self.loads.end(load)
        req.num_computed = req.num_pages * self.page_size
        self.cache.insert(req.all_ids, req.lease.pages, req.num_computed)
        self.cache.stats.host_loaded_pages += len(load.host_pages)
        queried, _ = self._lookups.get(req.request_id, (0, 0))
        self._lookups[req.request_id] = (queried, len(load.host_pages) * self.page_size)

    def _cache(self, req: Request) -> None:
        if self.cache is not None and req.lease is not None:
            self.cache.insert(req.all_ids, req.lease.pages, req.num_computed)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def counts(self) -> dict[str, int]:
        return {
            "waiting": len(self.waiting),
            "loading": len(self.loads.active) if self.loads is not None else 0,
            "running": len(self.running),
            "pages_free": self.allocator.num_free,
            "pages_used": self.allocator.num_used,
        }
