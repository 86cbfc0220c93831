"""The `triton` backend of a latent-attention pool (DeepSeek-V3's MLA): decodes are attended in
MLA's absorbed form by a Triton kernel over the latent pages (attention/triton_mla_decode.py);
everything else is the torch backend's (it is one): the generic store/gather pair, through
which the model attends prompt chunks in the expanded form (model/mla.py).

Invariants:
- `prepare` adds to the torch backend's metadata, for a step whose sequences are all decodes,
  the rows' lengths and page table (views of the Batch's staged upload, no device read) and
  the split count, chosen once per step from the longest row and shared by every layer.
- A mixed step (decodes, then prompt chunks) is two steps' metadata (`split`): its decodes'
  as above, their page table narrowed to their own longest row, and the torch backend's of
  the prompt sequences alone (`Batch.sequences_from`), so that the expanded gather pads and
  expands only those; the whole step's keeps every token's slots (one store of the latents)
  and no causal index, so nothing can gather every sequence of it by mistake.
- The split-KV scratch is a per-backend float32 buffer that only grows, reused by every layer
  and step (each layer's reduce has consumed it before the next layer's decode writes it: one
  stream).
- `kernel=LatentKernel.TORCH` runs `latent_decode_torch` instead, the pure-torch reference the
  tests check the kernel against; any device.
- CUDA graphs (engine/cuda_graphs.py `GraphableBackend`): a decode bucket's static metadata is
  the paged backend's `DecodeBuffers` (lengths, a page table as wide as the longest sequence,
  slots, split scratch of its own), its split count fixed for the longest sequence (an empty
  split exits at once). Its new latents are stored by a Triton kernel that skips slot -1 (the
  padded rows), where an eager step indexes the pool in torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

import torch

from pdserve.attention.backend import AttentionShape, StepSplit
from pdserve.attention.batch import Batch
from pdserve.attention.decode_bucket import DecodeBuffers, device_sms, fill_decode_bucket
from pdserve.attention.torch_backend import FP8, TorchBackend, TorchMetadata, gather_pages
from pdserve.attention.triton_decode import choose_num_splits, partial_shapes
from pdserve.attention.triton_index_scores import paged_index_scores, pick
from pdserve.attention.triton_mla_decode import head_blocks, paged_latent_decode
from pdserve.attention.triton_store import store_rows
from pdserve.kvcache.layout import INDEX_K, INDEX_K_SCALE, LATENT
from pdserve.kvcache.pool import KVPool


class LatentKernel(Enum):
    TRITON = "triton"  # attention/triton_mla_decode.py (CUDA, or the CPU interpreter)
    TORCH = "torch"  # latent_decode_torch: the reference, any device


@dataclass(frozen=True)
class LatentDecode:
    """The decodes of a step (all of it, or a mixed step's first rows): row r is sequence r
    and token r."""

    kv_lens: torch.Tensor  # [rows] int32
    page_table: torch.Tensor  # [rows, width] int32
    num_splits: int
    partial_out: torch.Tensor | None = None  # a graph bucket's own split scratch, else the
    partial_lse: torch.Tensor | None = None  # backend's shared one


@dataclass(frozen=True)
class MLAMetadata(TorchMetadata):
    decode: LatentDecode | None = None  # set: the step's latent attention runs absorbed
    slots: torch.Tensor | None = None  # [T] int32, -1 to skip: a graph bucket's store
    parts: StepSplit | None = None  # set: a mixed step, as its decodes' and the rest's metadata


def latent_decode_torch(
    q_latent: torch.Tensor,  # [rows, H, R]
    q_rope: torch.Tensor,  # [rows, H, P]
    cache: torch.Tensor,  # [pages, page_size, 1, R + P]: one layer's latent view
    page_table: torch.Tensor,  # [rows, width] int32
    kv_lens: torch.Tensor,  # [rows] int32; 0: a padded row (zeros out)
    scale: float,
    picked: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([rows, K] positions, counts)
) -> torch.Tensor:  # [rows, H, R], q_latent's dtype
    """`paged_latent_decode` in plain torch, with the expanded form's numerics (scores in the
    query's dtype, a float32 softmax, its weights back in that dtype): each row's pages
    gathered whole, the keys past its length masked (with `picked`: all but those listed)."""
    rank = q_latent.shape[2]
    latents = gather_pages(cache, page_table)[:, :, 0].to(q_latent.dtype)  # [rows, L, R + P]
    c, k_rope = latents.split([rank, latents.shape[2] - rank], dim=-1)
    scores = (q_latent @ c.transpose(1, 2) + q_rope @ k_rope.transpose(1, 2)) * scale
    length = latents.shape[1]  # scores: [rows, H, L]
    seen = torch.arange(length, device=c.device)[None, :] < kv_lens[:, None]  # [rows, L]
    if picked is not None:
        keys, counts = picked
        listed = torch.arange(keys.shape[1], device=c.device)[None, :] < counts[:, None]
        # the listed positions marked, the padding past each count to a spill column cut off
        at = torch.where(listed, keys.long().clamp(0, length - 1), length)
        chosen = torch.zeros(seen.shape[0], length + 1, dtype=torch.bool, device=c.device)
        seen &= chosen.scatter_(1, at, True)[:, :length]
    scores = scores.masked_fill(~seen[:, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
    return (probs @ c).masked_fill((kv_lens == 0)[:, None, None], 0)


def _widen(meta: TorchMetadata, decode: LatentDecode | None) -> MLAMetadata:
    return MLAMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, decode=decode)


class MLABackend(TorchBackend):
    name = "triton"

    def __init__(
        self,
        pool: KVPool,
        shape: AttentionShape,
        kernel: LatentKernel = LatentKernel.TRITON,
        num_splits: int | None = None,
    ) -> None:
        """`num_splits`: split every decode row's keys this many ways (None: by a heuristic
        of the GPU's size, the batch and the longest row)."""
        super().__init__(pool, shape)
        if LATENT not in {b.name for b in pool.layout.buffers}:
            raise ValueError(
                f"the latent attention backend needs a pool with a {LATENT!r} buffer (MLA); "
                f"this one holds {[b.name for b in pool.layout.buffers]}"
            )
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be at least 1, got {num_splits}")
        self.name = kernel.value
        self.kernel = kernel
        self.num_heads = shape.num_heads
        mla = getattr(shape, "mla", None)  # ModelArch's MLA dims (AttentionShape has no rank)
        self.rank = mla.kv_lora_rank if mla is not None else None
        self.num_splits = num_splits
        self.num_sms = device_sms(pool.device)
        self._scratch = torch.empty(0, dtype=torch.float32, device=pool.device)

    def prepare(self, batch: Batch) -> MLAMetadata:
        nd = batch.num_decodes
        if 0 < nd < batch.num_seqs:
            return self._mixed(batch)
        meta = super().prepare(batch)
        decode = None
        if nd == batch.num_seqs:
            splits = self._splits(batch.num_seqs, max(batch.host_kv_lens))
            decode = LatentDecode(batch.kv_lens, batch.page_table, splits)
        return _widen(meta, decode)

    def _mixed(self, batch: Batch) -> MLAMetadata:
        """A step's decodes (absorbed) and its prompt chunks (expanded), apart (module doc)."""
        nd, ps = batch.num_decodes, batch.page_size
        slots = batch.slot_mapping.long()  # [T]
        new_slots = (slots // ps, slots % ps)
        longest = max(batch.host_kv_lens[:nd])
        decode = LatentDecode(
            batch.kv_lens[:nd],
            batch.page_table[:nd, : -(-longest // ps)],
            self._splits(nd, longest),
        )
        decodes = MLAMetadata((new_slots[0][:nd], new_slots[1][:nd]), nd, [], [], decode=decode)
        rest = _widen(super().prepare(batch.sequences_from(nd)), None)
        return MLAMetadata(new_slots, nd, [], [], parts=StepSplit(nd, decodes, rest))

    def absorbs(self, metadata: MLAMetadata) -> bool:
        return metadata.decode is not None

    def split(self, metadata: MLAMetadata) -> StepSplit | None:
        return metadata.parts

    def attend_latent(
        self,
        layer: int,
        q_latent: torch.Tensor,  # [T, H, R]
        q_rope: torch.Tensor,  # [T, H, P]
        scale: float,
        metadata: MLAMetadata,
        picked: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, H, R]
        d = self._decode(metadata)
        cache = self._view(layer, LATENT)
        if self.kernel is LatentKernel.TORCH:
            return latent_decode_torch(
                q_latent, q_rope, cache, d.page_table, d.kv_lens, scale, picked
            )
        rows, heads, rank = q_latent.shape
        out = torch.empty(rows, heads, rank, dtype=q_latent.dtype, device=q_latent.device)
        part_out, part_lse = d.partial_out, d.partial_lse
        if part_out is None and d.num_splits > 1:
            part_out, part_lse = self._partials(rows, heads, d.num_splits, rank)
        keys, lengths = picked if picked is not None else (None, d.kv_lens)
        paged_latent_decode(
            q_latent,
            q_rope,
            cache,
            d.page_table,
            lengths,
            out,
            scale,
            d.num_splits,
            part_out,
            part_lse,
            keys=keys,
        )
        return out

    def index_topk(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D] float32
        weights: torch.Tensor,  # [T, H] float32
        qk_scale: float,
        topk: int,
        metadata: MLAMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] int32 positions, [T] int32 counts)
        d = self._decode(metadata)
        keys = self._view(layer, INDEX_K)
        fp8 = keys.dtype in FP8
        scales = self._view(layer, INDEX_K_SCALE) if fp8 else None
        scores = paged_index_scores(
            q, weights, keys, scales, d.page_table, d.kv_lens, qk_scale
        )  # [T, width * page_size]
        return pick(scores, d.kv_lens, topk)

    @staticmethod
    def _decode(metadata: MLAMetadata) -> LatentDecode:
        if metadata.decode is None:
            raise ValueError(
                "a latent decode verb on a step with prompt chunks (absorbs(); a mixed step's "
                "decodes have metadata of their own: split())"
            )
        return metadata.decode

    def store(
        self,
        layer: int,
        name: str,
        values: torch.Tensor,  # [T, *shape]
        metadata: TorchMetadata,
    ) -> None:
        slots = getattr(metadata, "slots", None)
        view = self._view(layer, name)
        if slots is None or (view.dtype in FP8 and values.dtype != view.dtype):
            super().store(layer, name, values, metadata)  # (which refuses the latter)
        else:  # a graph bucket's: padded rows (slot -1) store nothing
            rows = view if view.dim() == 4 else view.unsqueeze(2)  # [pages, page_size, 1, D]
            store_rows(values.reshape(values.shape[0], *rows.shape[2:]), rows, slots)

    # -- CUDA graphs (engine/cuda_graphs.py GraphableBackend) -----------------------------------
    def decode_buffers(self, rows: int, max_pages: int) -> DecodeBuffers:
        """A decode bucket's static metadata: `rows` rows of at most `max_pages` pages, its
        split count the heuristic's for rows that long, its own split scratch."""
        if self.kernel is not LatentKernel.TRITON or self.rank is None:
            raise ValueError("CUDA-graph decode needs the Triton latent kernel and MLA dims")
        splits = self._splits(rows, max_pages * self.page_size)
        width = (self.num_heads, self.rank)
        return DecodeBuffers.allocate(rows, max_pages, splits, width, self.pool.device)

    def decode_metadata(self, buffers: DecodeBuffers) -> MLAMetadata:
        """Metadata naming only `buffers`' tensors: what a CUDA graph is captured with."""
        split = buffers.num_splits > 1
        decode = LatentDecode(
            buffers.kv_lens,
            buffers.page_table,
            buffers.num_splits,
            buffers.partial_out if split else None,
            buffers.partial_lse if split else None,
        )
        none = torch.empty(0, dtype=torch.long, device=self.pool.device)
        rows = buffers.rows  # new_slots: unused, the store takes `slots`
        return MLAMetadata((none, none), rows, [], [], decode=decode, slots=buffers.slot_mapping)

    def prepare_decode_into(self, batch: Batch, buffers: DecodeBuffers) -> MLAMetadata:
        """Copy `batch`'s decodes into a bucket's static buffers (device-to-device, no host
        sync); rows past them become padding: kv_len 0 (output zeros), slot -1 (no store)."""
        fill_decode_bucket(batch, buffers)
        return self.decode_metadata(buffers)

    def _splits(self, rows: int, max_kv_len: int) -> int:
        if self.kernel is LatentKernel.TORCH:
            return 1
        if self.num_splits is not None:
            return self.num_splits
        return choose_num_splits(rows, head_blocks(self.num_heads), max_kv_len, self.num_sms)

    def _partials(
        self, rows: int, heads: int, splits: int, rank: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views of the backend's split-KV scratch (None with one split)."""
        if splits == 1:
            return None, None
        out_shape, lse_shape = partial_shapes(rows, heads, splits, rank)
        n_out, n_lse = rows * heads * splits * rank, rows * heads * splits
        if self._scratch.numel() < n_out + n_lse:
            with torch.inference_mode(False):  # a normal tensor, whoever first grows it
                self._scratch = torch.empty(
                    2 * (n_out + n_lse), dtype=torch.float32, device=self._scratch.device
                )
        return (
            self._scratch[:n_out].view(out_shape),
            self._scratch[n_out : n_out + n_lse].view(lse_shape),
        )
