"""Per-request state slots: the KV a model rewrites every step instead of appending to pages.

DeepSeek-V4 keeps, beside its paged compressed entries, a slot of state per running request
(kvcache/v4_layout.py: the sliding-window ring, the compressors' tails and overlap). The slots
live in the KV pool's own bytes, after its pages: slot s is `pages_per_slot` whole pages
(`first_page(s)` on), addressed like pages, so a shared or registered pool covers them and
page copies can move them byte for byte.
Inside a slot every (layer, component) has its own region, 64-byte aligned like a page's.

A slot belongs to one lease (kvcache/lease.py) and goes back when that lease ends, with the
pages, whoever ends it: a request finishing, being preempted or aborted, or a room that held it
after its request left. Like the page allocator, every verb checks before it changes anything:
a double give-back or a give-back of a slot never taken raises SlotError. Engine-thread only.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import torch

from pdserve.kvcache.allocator import PageAllocError
from pdserve.kvcache.buffer_spec import StateSpec

ALIGN = 64  # bytes, as a page's regions (kvcache/layout.py)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SlotRegion(NamedTuple):
    layer: int
    spec: StateSpec
    offset: int  # bytes from the slot's start
    nbytes: int


def slot_regions(specs: tuple[StateSpec, ...]) -> tuple[tuple[SlotRegion, ...], int]:
    """Every (layer, component) region of a slot, layer by layer, and the slot's bytes."""
    layers = sorted({layer for s in specs for layer in s.layers})
    out: list[SlotRegion] = []
    offset = 0
    for layer in layers:
        for s in specs:
            if layer in s.layers:
                out.append(SlotRegion(layer, s, offset, s.slot_bytes))
                offset = _align(offset + s.slot_bytes)
    return tuple(out), offset


def pages_per_slot(specs: tuple[StateSpec, ...], page_bytes: int) -> int:
    return -(-slot_regions(specs)[1] // page_bytes)


class SlotError(PageAllocError):
    """A state slot given back twice, given back while never taken, or none free."""


class StatePool:
    """`num_slots` slots over `data` [num_slots, slot_stride] uint8: rows of the KV pool's
    bytes after its pages (KVPool), slot s starting at pool page `first_page(s)`."""

    def __init__(
        self, specs: tuple[StateSpec, ...], data: torch.Tensor, first_pool_page: int,
        pages_each: int,
    ) -> None:  # fmt: skip
        self.specs = specs
        self.num_slots = data.shape[0]
        self.data = data
        self.first_pool_page = first_pool_page
        self.pages_each = pages_each
        self.regions, self.slot_bytes_used = slot_regions(specs)
        if self.slot_bytes_used > data.shape[1]:
            raise ValueError(
                f"a state slot needs {self.slot_bytes_used} bytes, has {data.shape[1]}"
            )
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        for r in self.regions:
            raw = data[:, r.offset : r.offset + r.nbytes]  # [num_slots, nbytes] uint8
            typed = raw.view(getattr(torch, r.spec.dtype))
            self._views[(r.layer, r.spec.name)] = typed.view(self.num_slots, *r.spec.shape)
        self._free = list(range(self.num_slots))  # a heap: the lowest slot first
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def first_page(self, slot: int) -> int:
        """The pool page where slot `slot` starts; it spans `pages_each` pages."""
        return self.first_pool_page + slot * self.pages_each

    def view(self, layer: int, name: str) -> torch.Tensor:
        """Component `name` of `layer`, every slot: [num_slots, *shape], aliasing the pool's
        bytes (KeyError if absent)."""
        try:
            return self._views[(layer, name)]
        except KeyError:
            raise KeyError(f"layer {layer} has no state component {name!r}") from None

    def take(self) -> int:
        """A free slot; SlotError if none is."""
        if not self._free:
            raise SlotError(f"all {self.num_slots} state slots are taken")
        slot = heapq.heappop(self._free)
        self._taken.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        if slot not in self._taken:
            raise SlotError(f"state slot {slot} given back, but it is not taken")
        self._taken.remove(slot)
        heapq.heappush(self._free, slot)

    def violations(self, held: list[int]) -> list[str]:
        """Slots whose holders are not exactly one lease each (`held`: every live lease's
        slot); empty when all is well."""
        out: list[str] = []
        seen: set[int] = set()
        for s in held:
            if s in seen:
                out.append(f"state slot {s}: held by more than one lease")
            seen.add(s)
        lost, stray = sorted(self._taken - seen), sorted(seen - self._taken)
        if lost:
            out.append(f"state slots taken but held by no lease: {lost[:20]}")
        if stray:
            out.append(f"state slots held by a lease but free: {stray[:20]}")
        if len(self._free) + len(self._taken) != self.num_slots:
            out.append("state slots: free and taken do not add up")
        return out
