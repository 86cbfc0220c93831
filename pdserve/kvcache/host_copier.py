"""How whole KV pages move between the device pool and the host pool: the copier.

A page is one contiguous run of `layout.page_bytes` bytes (kvcache/layout.py), so a copy moves
the run as bytes, whatever dtypes its buffers have: nothing here knows or assumes a dtype (the
incident this tier must not repeat, issue 15: a host mirror that assumed fp8 for a bf16
buffer). Both pools are uint8 `[num_pages, page_bytes]` of one descriptor (HostPool checks).

A copier issues a batch of page copies and returns a `Copy` whose `state()` says PENDING, DONE
or FAILED. Copies complete in the order they were issued (one stream), which is what lets the
host pool reuse a host page that an earlier copy still reads:

- `SyncCopier` (CPU): copies at once; every Copy is DONE when returned.
- `StreamCopier` (CUDA): one copy stream. Before a batch the stream waits for the compute
  stream (it reads KV that earlier steps wrote, and writes pages that earlier steps may still
  read); a batch ends with an event, which `state()` queries without blocking. After a write to
  the host the compute stream waits for that event on the GPU, so a device page handed out
  again is not overwritten by a later step before its bytes left.
- `ManualCopier` (tests): queues loads and runs them, in order, only when told; a load can be
  made to fail. It makes the asynchronous paths (a load still in flight, a timeout, an abort
  while loading) testable on the CPU, with real bytes arriving late. Its writes to the host
  run at once: on CUDA the compute stream waits for them, which the CPU cannot stand in for.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class CopyState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Copy(Protocol):
    def state(self) -> CopyState: ...


@dataclass
class Finished:
    """A copy that already ended (synchronous copies, or one that failed to be issued)."""

    ok: bool = True

    def state(self) -> CopyState:
        return CopyState.DONE if self.ok else CopyState.FAILED


class HostCopier(Protocol):
    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]], to_host: bool
    ) -> Copy:
        """Copy page `s` of `src` to page `d` of `dst` for each (s, d) in `pairs`; both are
        uint8 [num_pages, page_bytes]. `to_host`: dst is the host pool (a write), else a load."""
        ...


def runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, n): maximal runs where both page numbers go up by one, one copy each."""
    out: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    pairs: Sequence[tuple[int, int]],
    non_blocking: bool = False,
) -> None:
    if src.shape[1] != dst.shape[1] or src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        raise ValueError(
            f"pages of {src.shape[1]} {src.dtype} bytes cannot be copied to pages of "
            f"{dst.shape[1]} {dst.dtype} bytes"
        )
    for s, d, n in runs(pairs):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)


class SyncCopier:
    """The CPU tier: a copy is done when `copy` returns."""

    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]], to_host: bool
    ) -> Copy:
        copy_pages(src, dst, pairs)
        return Finished()


@dataclass
class EventCopy:
    event: torch.cuda.Event

    def state(self) -> CopyState:
        return CopyState.DONE if self.event.query() else CopyState.PENDING


class StreamCopier:
    """The CUDA tier: copies on one side stream, completion seen through events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]], to_host: bool
    ) -> Copy:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # after every step issued so far
        with torch.cuda.stream(self.stream):
            copy_pages(src, dst, pairs, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if to_host:  # the device pages are free again: no later step may write them first
            compute.wait_event(event)
        return EventCopy(event)


@dataclass
class ManualCopy:
    fail: bool = False
    ran: bool = False

    def state(self) -> CopyState:
        if not self.ran:
            return CopyState.PENDING
        return CopyState.FAILED if self.fail else CopyState.DONE


@dataclass
class ManualCopier:
    """Tests: loads wait in a queue (in issue order, like a stream) until `complete`."""

    queue: list[tuple[ManualCopy, torch.Tensor, torch.Tensor, list[tuple[int, int]]]] = field(
        default_factory=list
    )

    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]], to_host: bool
    ) -> Copy:
        if to_host:
            copy_pages(src, dst, pairs)
            return Finished()
        c = ManualCopy()
        self.queue.append((c, src, dst, list(pairs)))
        return c

    def complete(self, upto: Copy | None = None, fail: bool = False) -> int:
        """Run queued copies in order through `upto` (None: all); `fail` marks `upto` failed
        (its bytes are still written: a failed copy may have written anything). Returns how
        many ran."""
        n = 0
        while self.queue:
            c, src, dst, pairs = self.queue.pop(0)
            copy_pages(src, dst, pairs)
            c.ran = True
            n += 1
            if c is upto:
                c.fail = fail
                break
        return n
