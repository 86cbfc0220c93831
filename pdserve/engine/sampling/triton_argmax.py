"""The greedy pick on CUDA: argmax over each row of the logits, as two small Triton kernels.

torch's `argmax(dim=-1)` reduces a row in one thread block, so over a large vocabulary it
is slow whatever the batch: as long as the whole rest of a batch-1 step's sampling and copies
together (benchmarks/kernels/gpu_kernels.py --step tick; benchmarks/RESULTS.md, 2026-12-02 second
session). Here a row is cut into CHUNK-token pieces, one program each
(`rows x vocab / CHUNK` programs), and a second kernel picks each row's winner among its
pieces' winners.

The answer is torch's, bit for bit: the first index of the row's greatest value, where NaN
counts as greater than every number (torch's max and argmax propagate NaN) and the first NaN
wins among NaNs. The logits may be float32 or the model's 16-bit dtype: a 16-bit value widens
to float32 exactly, so the pick is the same either way (the sampler skips the float32 copy of
the logits when every row is greedy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import enter, launch

CHUNK = 4096  # tokens per program of the first kernel: 32 programs a row for a 128K vocab


@triton.jit
def _pick(vals, idx, big):
    """(value, index) of the first NaN in `vals` if any, else of the first greatest value;
    `big` is above every index (the vocabulary size)."""
    nan = vals != vals
    first_nan = tl.min(tl.where(nan, idx, big), axis=0)
    key = tl.where(nan, float("-inf"), vals)
    top = tl.max(key, axis=0)
    first_top = tl.min(tl.where(key == top, idx, big), axis=0)
    has_nan = first_nan < big
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@triton.jit
def _argmax_chunk_kernel(
    logits_ptr,  # [R, V]
    val_ptr,  # [R, C] float32: each chunk's winning value
    idx_ptr,  # [R, C] int64: its index in the row
    stride_row,
    V,
    num_chunks,
    CHUNK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK_V + tl.arange(0, CHUNK_V).to(tl.int64)
    ok = idx < V
    vals = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf"))
    val, at = _pick(vals.to(tl.float32), tl.where(ok, idx, V), V)
    tl.store(val_ptr + row * num_chunks + chunk, val)
    tl.store(idx_ptr + row * num_chunks + chunk, at)


@triton.jit
def _argmax_row_kernel(
    val_ptr,  # [R, C]
    idx_ptr,  # [R, C]
    out_ptr,  # [R] int64
    num_chunks,
    V,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    vals = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + c, mask=ok, other=V)
    # Chunks are in index order, so the first NaN (or greatest) index among the chunks'
    # winners is the row's.
    _, at = _pick(vals, idx, V)
    tl.store(out_ptr + row, at)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (float32, bfloat16 or float16; unit stride along V) -> [R] int64, the same
    as `logits.argmax(dim=-1)`."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(
            f"argmax: wants [R, V > 0] logits with unit stride along V, got "
            f"{tuple(logits.shape)} (stride {logits.stride()})"
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    _argmax_chunk_kernel[(rows, chunks)](
        logits,
        vals,
        idx,
        logits.stride(0),
        vocab,
        chunks,
        CHUNK_V=CHUNK,
        num_warps=8,
        **launch(logits.device, _argmax_chunk_kernel),
    )
    _argmax_row_kernel[(rows,)](
        vals,
        idx,
        out,
        chunks,
        vocab,
        BLOCK_C=max(16, triton.next_power_of_2(chunks)),
        **launch(logits.device, _argmax_row_kernel),
    )
    return out
