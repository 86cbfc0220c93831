"""The penalties' state on the device: each penalised request's seen tokens and output-token
counts, kept from step to step, so a step uploads nothing per token (issue 13 part 4).

A request gets a **slot** the first time it samples with a penalty: row `slot` of two
[capacity, vocab] tensors, `seen` (bool: the token is in the prompt or the outputs; the
repetition penalty) and `counts` (float32: how often it was sampled; frequency and presence).
Both are exactly what the stateless path (`processors.apply_penalties`) scatters from the
host's ids each step: counts are whole numbers, exact in a float32 below 2**24. The slot is
built once from the host's ids; after that each launched step adds the ids it just sampled, on
the device (`count`): a token still in flight is counted before the host sees it, so under
overlapped scheduling a penalty row needs nothing from the step in flight.

Memory: 5 bytes per vocab entry per slot, 742 KiB at vocab 151,936 (148 KiB of mask, 594 KiB
of counts): 46 MiB for 64 slots, 186 MiB for 256. Nothing is allocated until a penalised
request samples; the capacity doubles as needed up to `max_slots` (the engine's max_running).
vLLM's GPU model runner keeps two such rows (int32 output counts, a bit-packed prompt mask)
for every request slot, penalised or not, allocated up front.

Invariant: `_Slot.counted` is how many leading output positions of its request are in its
counts row. It equals `Request.num_output_tokens` at each launch when every token went through
`count`. Positions the sampler did not launch (a decode worker's first token, sampled by the
prefill worker; a token sampled row by row by the isolation fallback) are on the host by then
and are added from `output_ids` (`pending == 0`; else it is a bug and the row fails). A slot
lives until its request finishes (seen lazily, at the next `plan`), also through preemption:
the outputs of a preempted request stay its outputs. When the slots are full, one whose
request is not in the step and has no token in flight (or only its last) is taken, to be
rebuilt from the host if that request samples again. Only if none is free does the capacity
grow past `max_slots`: a step holds at most max_running rows, so that takes requests preempted
with a token in flight, and stays below twice max_running.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.request import Request

log = logging.getLogger(__name__)

INITIAL_SLOTS = 8


@dataclass
class _Slot:
    index: int
    req: Request
    counted: int  # leading output positions whose tokens are in counts[index]


@dataclass
class SlotPlan:
    """One step's use of the state, decided on the host. Host lists: `slots` one per penalised
    row; `clear` the slots to rebuild; (`prompt_at`, `prompt_ids`) and (`count_at`,
    `count_ids`) the (slot, token) pairs to mark or count first; `counted` each row's count
    of positions once the step's own token is in."""

    reqs: list[Request]
    slots: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)
    clear: list[int] = field(default_factory=list)
    prompt_at: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    count_at: list[int] = field(default_factory=list)
    count_ids: list[int] = field(default_factory=list)


class PenaltyState:
    """The slots of one engine's sampler; only the engine thread uses it."""

    def __init__(self, max_slots: int) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self.seen: torch.Tensor | None = None  # [capacity, vocab] bool: prompt or outputs
        self.counts: torch.Tensor | None = None  # [capacity, vocab] float32: outputs
        self._slots: dict[int, _Slot] = {}  # by id(request); the slot holds the request
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, req: Request) -> int | None:
        s = self._slots.get(id(req))
        return None if s is None else s.index

    # -- host side ------------------------------------------------------------------------
    def plan(self, reqs: Sequence[Request], vocab: int, device: torch.device) -> SlotPlan:
        """Slots for `reqs` (the step's penalised rows) and what to rebuild first; RuntimeError
        naming the request whose ids are neither counted nor on the host (a bug)."""
        self._ensure(vocab, device)
        self._forget_finished()
        plan = SlotPlan(list(reqs))
        try:
            self._plan_rows(plan, vocab, device)
        except Exception:
            self.abandon(plan)
            raise
        return plan

    def _plan_rows(self, plan: SlotPlan, vocab: int, device: torch.device) -> None:
        in_step = {id(r) for r in plan.reqs}
        for r in plan.reqs:
            n = r.num_output_tokens
            s = self._slots.get(id(r))
            if s is not None and s.counted != n and r.pending:
                raise RuntimeError(
                    f"request {r.request_id}: {n - s.counted} output tokens are neither "
                    "counted on the device nor on the host"
                )
            if s is None:
                if r.pending:
                    raise RuntimeError(
                        f"request {r.request_id}: penalties over a token still in flight"
                    )
                s = self._take(r, in_step, vocab, device)
                self._rebuild(plan, s)
            elif s.counted > n:  # never expected: start again from the host
                self._rebuild(plan, s)
            elif s.counted < n:  # sampled elsewhere, now on the host: count them
                plan.count_at += [s.index] * (n - s.counted)
                plan.count_ids += r.output_ids[s.counted : n]
            plan.slots.append(s.index)
            plan.counted.append(n + 1)

    def commit(self, plan: SlotPlan) -> None:
        """The step's counts were queued: the rows' slots now count its token."""
        for r, n in zip(plan.reqs, plan.counted, strict=True):
            self._slots[id(r)].counted = n

    def abandon(self, plan: SlotPlan) -> None:
        """The step failed part way: its rows' slots may be half-written; drop them (each is
        rebuilt from the host when its request samples again)."""
        for r in plan.reqs:
            s = self._slots.pop(id(r), None)
            if s is not None:
                self._free.append(s.index)

    def _rebuild(self, plan: SlotPlan, s: _Slot) -> None:
        r = s.req
        plan.clear.append(s.index)
        plan.prompt_at += [s.index] * len(r.prompt_ids)
        plan.prompt_ids += r.prompt_ids
        plan.count_at += [s.index] * len(r.output_ids)
        plan.count_ids += r.output_ids
        s.counted = len(r.output_ids)

    def _forget_finished(self) -> None:
        for key, s in list(self._slots.items()):
            if s.req.status.finished:
                del self._slots[key]
                self._free.append(s.index)

    def _take(self, req: Request, in_step: set[int], vocab: int, device: torch.device) -> _Slot:
        if not self._free and self.capacity < self.max_slots:
            self._grow(min(self.max_slots, max(INITIAL_SLOTS, 2 * self.capacity)), vocab, device)
        if not self._free:
            victim = next(
                (
                    key
                    for key, s in self._slots.items()
                    if key not in in_step and (s.req.pending == 0 or s.req.pending_last)
                ),
                None,
            )
            if victim is not None:
                self._free.append(self._slots.pop(victim).index)
            else:
                log.warning("penalty slots: all %d in use; growing", self.capacity)
                self._grow(2 * self.capacity, vocab, device)
        s = _Slot(self._free.pop(), req, 0)
        self._slots[id(req)] = s
        return s

    # -- device side ----------------------------------------------------------------------
    def _ensure(self, vocab: int, device: torch.device) -> None:
        if self.counts is not None and (
            self.counts.shape[1] != vocab or self.counts.device != device
        ):
            self.seen = self.counts = None  # another model's logits: start again
            self._slots.clear()
            self._free.clear()

    def _grow(self, capacity: int, vocab: int, device: torch.device) -> None:
        old = self.capacity
        # Normal tensors even when the first use is inside inference mode: they are updated
        # in place in and out of it.
        with torch.inference_mode(False):
            seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
            counts = torch.zeros(capacity, vocab, dtype=torch.float32, device=device)
            if self.seen is not None and self.counts is not None:
                seen[:old] = self.seen
                counts[:old] = self.counts
        self.seen, self.counts = seen, counts
        self._free.extend(reversed(range(old, capacity)))  # the lowest index is taken first

    def stage(
        self,
        clear: torch.Tensor | None,
        prompt: tuple[torch.Tensor, torch.Tensor] | None,
        counts: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Queue a plan's rebuilds before the step reads the rows: zero the `clear` slots
        [C] int64, mark the (slot, id) pairs of `prompt` ([K], [K] int64) seen, count (and
        mark) those of `counts`."""
        assert self.seen is not None and self.counts is not None  # plan() allocated them
        if clear is not None:
            self.seen.index_fill_(0, clear, False)
            self.counts.index_fill_(0, clear, 0.0)
        if prompt is not None:
            self._mark(*prompt)
        if counts is not None:
            self.count(*counts)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [P] int64 -> (seen [P, V] bool, output counts [P, V] float32)."""
        assert self.seen is not None and self.counts is not None
        return self.seen.index_select(0, slots), self.counts.index_select(0, slots)

    def count(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """counts[slots[i], ids[i]] += 1 and seen, on the device (a pair may repeat)."""
        assert self.counts is not None
        one = torch.ones((), dtype=self.counts.dtype, device=self.counts.device)
        self.counts.index_put_((slots, ids), one.expand(ids.shape), accumulate=True)
        self._mark(slots, ids)

    def _mark(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        assert self.seen is not None
        true = torch.ones((), dtype=torch.bool, device=self.seen.device)
        self.seen.index_put_((slots, ids), true.expand(ids.shape))
