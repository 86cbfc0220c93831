"""Persistent page-table rows: one host row per sequence, updated as its pages grow.

Every step's Batch carries the page table of every sequence in it. Rebuilt from Python lists
each step, that is a list copy per sequence per step (about 20 pages for a 320-token context),
the largest share of a large decode batch's build. Here each sequence (its `owner`: the
runner passes the Request) keeps a *slot*, a row of one numpy array holding its pages;
`sync` writes only the pages added since the sequence's last step (a page every `page_size`
decode steps), and a step's table is one numpy gather of its slots' rows (`gather`).

Invariants:
- A row is in sync with the page list it was last synced from while that list only grows
  (a lease's `extend` and `share` append). Another list object (a new lease after a
  preemption, a table built by hand) or a shorter one rewrites the row. A request's lease
  never drops pages in place (only the prefix cache's own lease does).
- Columns past a row's synced pages hold stale values: `gather` zeroes every column past the
  pages a sequence needs (the Batch's padding, attention/batch.py).
- A slot is its owner's until `release`; a released slot is reused, and rewritten, by the
  next owner. The table is host memory the device never reads: a step's gathered rows reach
  the device through the staging buffer (staging.py), so reusing a slot never races a step
  in flight.
- Owners are held by reference while they own a slot, so `id(owner)` stays unique.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

MIN_ROWS = 64
MIN_WIDTH = 64  # pages


class PageTable:
    def __init__(self, gone: Callable[[object], bool] = lambda _owner: False) -> None:
        """`gone(owner)`: whether an owner has left for good (a finished request); such slots
        are taken back before the table grows, should nobody have released them."""
        self._gone = gone
        self._rows = np.zeros((MIN_ROWS, MIN_WIDTH), dtype=np.int32)  # [slots, width] pages
        self._synced = [0] * MIN_ROWS  # pages of each row written from its source
        self._source: list[Sequence[int] | None] = [None] * MIN_ROWS  # the list synced from
        self._owner: list[object | None] = [None] * MIN_ROWS
        self._slot: dict[int, int] = {}  # id(owner) -> slot
        self._free = list(range(MIN_ROWS - 1, -1, -1))  # a stack: low slots first

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._slot)

    def slot_of(self, owner: object) -> int | None:
        return self._slot.get(id(owner))

    def row(self, owner: object) -> list[int]:
        """The pages `owner`'s row was synced to (tests and tools)."""
        slot = self._slot[id(owner)]
        return self._rows[slot, : self._synced[slot]].tolist()

    def sync(self, owner: object, pages: Sequence[int], need: int) -> int:
        """`owner`'s slot, its row holding `pages` (which must hold at least `need` pages)."""
        slot = self._slot.get(id(owner))
        if slot is not None and self._current(slot, pages, need):
            return slot  # most steps: no page added
        n = len(pages)
        if n < need:
            raise ValueError(f"a sequence needs {need} pages, it holds {n}")
        if slot is None:
            slot = self._assign(owner)
        done = self._synced[slot]
        if pages is not self._source[slot] or n < done:
            done = 0  # a new list, or one that shrank: rewrite the row
            self._source[slot] = pages
        if n > done:
            if n > self._rows.shape[1]:
                self._widen(n)
            self._rows[slot, done:n] = pages[done:n]
            self._synced[slot] = n
        return slot

    def _current(self, slot: int, pages: Sequence[int], need: int) -> bool:
        """Whether `slot`'s row holds `pages`, and they are enough."""
        n = len(pages)
        return pages is self._source[slot] and n == self._synced[slot] and n >= need

    def sync_all(
        self, owners: Sequence[object], pages: Sequence[Sequence[int]], need: Sequence[int]
    ) -> list[int]:
        """`sync` of each (owner, pages, need), in one call: a step's decodes."""
        sync = self.sync
        return [sync(o, p, n) for o, p, n in zip(owners, pages, need, strict=True)]

    def release(self, owner: object) -> None:
        """`owner` left: its slot is free (a no-op for an owner without one)."""
        slot = self._slot.pop(id(owner), None)
        if slot is None:
            return
        self._owner[slot] = self._source[slot] = None
        self._synced[slot] = 0
        self._free.append(slot)

    def gather(self, slots: Sequence[int], need: np.ndarray, out: np.ndarray) -> None:
        """out[i] (of a zeroed [len(slots), width] array) = slot i's first need[i] pages, then
        zeros."""
        width = min(out.shape[1], self._rows.shape[1])
        out[:, :width] = self._rows[np.asarray(slots, dtype=np.intp), :width]
        out[np.arange(out.shape[1])[None, :] >= need[:, None]] = 0

    def _assign(self, owner: object) -> int:
        if not self._free:
            for o in [o for o in self._owner if o is not None and self._gone(o)]:
                self.release(o)
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot[id(owner)] = slot
        self._owner[slot] = owner
        return slot

    def _grow(self) -> None:
        old = len(self._owner)
        rows = np.zeros((2 * old, self._rows.shape[1]), dtype=np.int32)
        rows[:old] = self._rows
        self._rows = rows
        self._synced += [0] * old
        self._source += [None] * old
        self._owner += [None] * old
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, n: int) -> None:
        width = self._rows.shape[1]
        while width < n:
            width *= 2
        rows = np.zeros((self._rows.shape[0], width), dtype=np.int32)
        rows[:, : self._rows.shape[1]] = self._rows
        self._rows = rows
