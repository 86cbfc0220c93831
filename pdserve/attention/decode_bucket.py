"""A CUDA-graph decode bucket's static buffers, shared by the paged backend
(attention/triton_backend.py) and the latent one (attention/mla_backend.py): the rows' lengths,
page table and slots at fixed addresses, its split-KV scratch, and the per-step copy of a Batch's
decodes into them (rows past them padding: kv_len 0, slot -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention.batch import INDEX_DTYPE, Batch
from pdserve.attention.triton_decode import partial_shapes

CPU_SMS = 4  # the "GPU size" the split heuristic assumes under the CPU interpreter


@dataclass(frozen=True)
class DecodeBuffers:
    """A decode bucket's static metadata: fixed addresses a CUDA graph can be captured over."""

    kv_lens: torch.Tensor  # [rows] int32: 0 for a padded row
    page_table: torch.Tensor  # [rows, max_pages] int32
    slot_mapping: torch.Tensor  # [rows] int32: -1 for a padded row (store_kv skips it)
    num_splits: int
    partial_out: torch.Tensor  # [rows, Hq, num_splits, D] float32 (empty with one split)
    partial_lse: torch.Tensor  # [rows, Hq, num_splits] float32

    @property
    def rows(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @classmethod
    def allocate(
        cls,
        rows: int,
        max_pages: int,
        splits: int,
        partial: tuple[int, int],  # (heads, width) of a split's partial output per row
        device: torch.device,
        slot_mapping: torch.Tensor | None = None,
    ) -> DecodeBuffers:
        """A bucket's buffers: lengths 0, slots -1 (unless a larger step's view is given), its
        own split scratch (none with one split). The paged and the latent backends' alike."""
        if rows < 1 or max_pages < 1:
            raise ValueError(f"a decode bucket needs rows and pages, got {rows} x {max_pages}")
        out_shape, lse_shape = partial_shapes(rows, partial[0], splits, partial[1])
        if splits == 1:
            out_shape, lse_shape = (0,), (0,)
        if slot_mapping is None:
            slot_mapping = torch.full((rows,), -1, dtype=INDEX_DTYPE, device=device)
        return cls(
            kv_lens=torch.zeros(rows, dtype=INDEX_DTYPE, device=device),
            page_table=torch.zeros(rows, max_pages, dtype=INDEX_DTYPE, device=device),
            slot_mapping=slot_mapping,
            num_splits=splits,
            partial_out=torch.empty(out_shape, dtype=torch.float32, device=device),
            partial_lse=torch.empty(lse_shape, dtype=torch.float32, device=device),
        )


def device_sms(device: torch.device) -> int:
    """The SM count the split heuristic sizes for: the GPU's, or CPU_SMS under the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def copy_decodes(batch: Batch, buffers: DecodeBuffers) -> None:
    """The decodes' KV lengths and page-table rows into `buffers` (rows past: kv_len 0)."""
    n, width = batch.num_decodes, batch.page_table.shape[1]
    if n > buffers.rows or width > buffers.max_pages:
        raise ValueError(
            f"a batch of {n} decodes x {width} pages does not fit a bucket of "
            f"{buffers.rows} rows x {buffers.max_pages} pages"
        )
    buffers.kv_lens[:n].copy_(batch.kv_lens[:n])
    if n < buffers.rows:
        buffers.kv_lens[n:].zero_()
    buffers.page_table[:n, :width].copy_(batch.page_table[:n])


def fill_decode_bucket(batch: Batch, buffers: DecodeBuffers) -> None:
    """`copy_decodes`, and the decodes' slots (rows past them: slot -1, no store)."""
    n = batch.num_decodes
    copy_decodes(batch, buffers)
    buffers.slot_mapping[:n].copy_(batch.slot_mapping[:n])
    if n < buffers.rows:
        buffers.slot_mapping[n:].fill_(-1)
