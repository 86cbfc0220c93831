"""One host-to-device copy per step for many small integer tensors.

A step's metadata is a handful of small index tensors (token ids, positions, slots, lengths,
a page table). Copied one by one, each is a blocking transfer from pageable memory; packed,
they are one `non_blocking` copy from a pinned buffer. `Staging` packs lists of ints (written
straight into the buffer, with no tensor per list: on a CPU a small tensor op costs more than
a decode's whole share of the metadata) or tensors into its persistent host buffer (pinned on
CUDA), copies the used prefix into its persistent device buffer at once and returns each part
as a view of that buffer.

Invariants:
- Views returned by `upload` stay valid until the next `upload` (the device buffer is reused;
  GPU work already queued on the stream reads the old values, since the next copy is queued
  after it). Both buffers only grow, by doubling.
- The pinned host buffer is not rewritten while the previous copy may still read it: the copy
  records an event, and the next `upload` waits on it first.
- On the CPU the "device" copy is a plain clone of the packed prefix, so views never alias the
  reused host buffer. `_to_device` is the one place the copy is made: a test stands a reused,
  poisoned buffer in for CUDA's (tests/engine/test_emulated_cuda.py).
- Every part starts on an `ALIGN`-element boundary (64 bytes for int32), as vectorised kernels
  like their pointers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.runtime.gpu_wait import wait_event

ALIGN = 16  # elements: each part's offset in the buffer is a multiple of this
MIN_CAPACITY = 4096  # elements


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Staging:
    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int32) -> None:
        self.device = device
        self.dtype = dtype
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=dtype)  # [capacity], pinned on CUDA
        self._host_np = self._host.numpy()
        self._device = torch.empty(0, dtype=dtype, device=device)  # [capacity]; unused on CPU
        self._copied: torch.cuda.Event | None = None  # the last copy out of `_host`

    @property
    def capacity(self) -> int:
        """Elements the buffers hold before they must grow."""
        return self._host.numel()

    def upload(
        self, parts: Sequence[Sequence[int] | np.ndarray | torch.Tensor]
    ) -> list[torch.Tensor]:
        """`parts` (lists of ints, 1-D numpy arrays, or host tensors of any shape; values must
        fit `dtype`) as views of one device buffer, in order, after one copy: a list or an
        array comes back 1-D, a tensor in its own shape. Valid until the next `upload`."""
        sizes = [p.numel() if isinstance(p, torch.Tensor) else len(p) for p in parts]
        offsets = []
        end = 0
        for n in sizes:
            offsets.append(end)
            end = _round_up(end + n, ALIGN)
        if self._copied is not None:
            wait_event(self._copied, "the last upload")  # the pinned buffer may be its source
            self._copied = None
        if end > self.capacity:
            self._grow(end)
        for p, o, n in zip(parts, offsets, sizes, strict=True):
            if isinstance(p, torch.Tensor):
                self._host[o : o + n].copy_(p.reshape(-1))
            elif n:
                self._host_np[o : o + n] = p  # numpy converts a list (or casts) in one pass
        flat = self._to_device(end)
        # A slice is 1-D already: only a tensor part of another shape costs a view (each
        # torch call is a few µs of host time a step on CUDA).
        return [
            flat[o : o + n].view(p.shape)
            if isinstance(p, torch.Tensor) and p.dim() != 1
            else flat[o : o + n]
            for p, o, n in zip(parts, offsets, sizes, strict=True)
        ]

    def _to_device(self, end: int) -> torch.Tensor:
        """The packed prefix `[:end]` in the device buffer, by one copy queued on the stream
        (the event marks when the pinned source may be rewritten); on the CPU a clone."""
        if self.device.type == "cpu":
            return self._host[:end].clone()
        flat = self._device[:end]
        flat.copy_(self._host[:end], non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return flat

    def _grow(self, need: int) -> None:
        cap = max(MIN_CAPACITY, self.capacity)
        while cap < need:
            cap *= 2
        # Normal tensors even when first grown under inference_mode (the runner's forward):
        # an inference tensor could not be written outside it (a Batch built by hand).
        with torch.inference_mode(False):
            self._host = torch.empty(cap, dtype=self.dtype, pin_memory=self.pinned)
            self._host_np = self._host.numpy()  # the same memory, for writes from lists
            if self.device.type != "cpu":
                self._device = torch.empty(cap, dtype=self.dtype, device=self.device)
