"""The `triton` attention backend: paged decode, paged prefill and the KV store as Triton
kernels (triton_decode.py, triton_prefill.py, triton_store.py) over the pool's typed views.

CUDA only in serving; on the CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how the CPU tests check it against the `torch` backend.

Invariants:
- `prepare` reads the Batch without a device read or a copy: the decode rows' lengths and
  page table are views of the Batch's staged upload; the split-KV scratch is a per-backend
  float32 buffer that only grows, reused by every layer and step (each layer's decode has
  consumed it before the next one writes it: one stream).
- Decode rows are the first `num_decodes` sequences (one token each): q row r is sequence r.
- CUDA graphs: `decode_buffers(rows, max_pages)` allocates a decode bucket's static metadata
  and scratch once; per step `prepare_decode_into(batch, buffers)` copies the Batch's decodes
  into it (padded rows: kv_len 0, slot -1) and returns metadata that names only those static
  tensors, so a graph captured with it replays the same kernels on the new values. Likewise
  `prefill_buffers(tokens, seqs, max_pages, decodes)` and `prepare_prefill_into(batch,
  buffers)` for a whole step that carries prefill chunks: its decodes in a decode section of
  `decodes` rows (attended by the decode kernel), then its chunks (the prefill kernel); padded
  tokens: slot -1; padded decode rows and sequences: kv_len 0, no tokens. The kernels' grids
  depend only on a bucket's rows, tokens, sequences and split count, never on lengths.
- A decode section wider than the step's decodes covers some of its chunk rows too: the
  decode kernel writes zeros there (kv_len 0), and the prefill kernel, launched after it on
  the same stream, writes those rows' real outputs over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention.backend import AttentionShape, Rope
from pdserve.attention.batch import INDEX_DTYPE, Batch
from pdserve.attention.decode_bucket import (
    DecodeBuffers,
    copy_decodes,
    device_sms,
    fill_decode_bucket,
)
from pdserve.attention.triton_decode import choose_num_splits, paged_decode, partial_shapes
from pdserve.attention.triton_prefill import paged_prefill
from pdserve.attention.triton_store import rope_store_kv, store_kv
from pdserve.kvcache.pool import KVPool


@dataclass(frozen=True)
class PrefillBuffers:
    """The static metadata of a bucket of steps that carry prefill chunks: up to `tokens`
    tokens, the step's decodes first (up to `decode.rows`, none without a decode section),
    then up to `seqs` chunks."""

    slot_mapping: torch.Tensor  # [tokens] int32: -1 for a padded token (store_kv skips it)
    decode: DecodeBuffers | None  # rows 0 .. decode.rows-1; its slot_mapping is a view of ours
    query_start: torch.Tensor  # [seqs + 1] int32: the chunks' rows in the step (after decodes)
    kv_lens: torch.Tensor  # [seqs] int32: 0 for a padded sequence
    page_table: torch.Tensor  # [seqs, max_pages] int32

    @property
    def tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]


@dataclass(frozen=True)
class DecodeMetadata:
    """Rows 0 .. rows-1 of the step are decodes, attended by the decode kernel."""

    kv_lens: torch.Tensor  # [rows] int32
    page_table: torch.Tensor  # [rows, width] int32
    num_splits: int
    partial_out: torch.Tensor | None  # [rows, Hq, num_splits, D] float32 when num_splits > 1
    partial_lse: torch.Tensor | None  # [rows, Hq, num_splits] float32

    @property
    def rows(self) -> int:
        return self.kv_lens.shape[0]


@dataclass(frozen=True)
class PrefillMetadata:
    """Sequences first_seq .. B-1 are prefill chunks, attended by the prefill kernel."""

    first_seq: int
    max_tokens: int  # at least the chunks' tokens together (sizes the kernel's grid)
    query_start: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, width] int32


@dataclass(frozen=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int32: each new token's slot; < 0 = not stored
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


class TritonBackend:
    name = "triton"

    def __init__(self, pool: KVPool, shape: AttentionShape, num_splits: int | None = None) -> None:
        """`num_splits`: split every decode row's keys this many ways (None: by a heuristic
        of the GPU's size, the batch and the longest row)."""
        self.kv = [pool.layer(i) for i in range(pool.layout.num_layers)]
        k0 = self.kv[0][0]  # [pages, page_size, Hkv, D]
        if shape.num_heads % shape.num_kv_heads or k0.shape[2:] != (
            shape.num_kv_heads,
            shape.head_dim,
        ):
            raise ValueError(
                f"the triton backend needs query heads a multiple of KV heads and a pool of "
                f"[kv_heads, head_dim] = ({shape.num_kv_heads}, {shape.head_dim}) per token; "
                f"got {shape.num_heads} query heads and {tuple(k0.shape[2:])} per token"
            )
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be at least 1, got {num_splits}")
        self.device = pool.device
        self.page_size = pool.page_size
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.num_splits = num_splits
        self.num_sms = device_sms(self.device)
        self._scratch = torch.empty(0, dtype=torch.float32, device=self.device)

    # -- metadata ------------------------------------------------------------------------
    def prepare(self, batch: Batch) -> TritonMetadata:
        nd = batch.num_decodes
        decode = None
        if nd:
            splits = self._splits(nd, max(batch.host_kv_lens[:nd]))
            part_out, part_lse = self._partials(nd, splits)
            decode = DecodeMetadata(
                batch.kv_lens[:nd], batch.page_table[:nd], splits, part_out, part_lse
            )
        prefill = None
        if nd < batch.num_seqs:
            prefill = PrefillMetadata(
                nd,
                batch.num_tokens - nd,  # decodes are one token each
                batch.query_start,
                batch.kv_lens,
                batch.page_table,
            )
        return TritonMetadata(batch.slot_mapping, decode, prefill)

    def decode_buffers(
        self,
        rows: int,
        max_pages: int,
        num_splits: int | None = None,
        slot_mapping: torch.Tensor | None = None,
    ) -> DecodeBuffers:
        """Static metadata for a decode bucket of `rows` rows whose sequences hold at most
        `max_pages` pages each; `num_splits` None: as for `rows` rows of max_pages pages;
        `slot_mapping`: the rows' slots as a view of a larger step's (a step bucket's decode
        section), else its own."""
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be at least 1, got {num_splits}")
        splits = num_splits or self._splits(rows, max_pages * self.page_size)
        width = (self.num_heads, self.head_dim)
        return DecodeBuffers.allocate(rows, max_pages, splits, width, self.device, slot_mapping)

    def decode_metadata(self, buffers: DecodeBuffers) -> TritonMetadata:
        """Metadata naming only `buffers`' tensors: what a CUDA graph is captured with."""
        return TritonMetadata(buffers.slot_mapping, self._decode_section(buffers), None)

    @staticmethod
    def _decode_section(buffers: DecodeBuffers) -> DecodeMetadata:
        split = buffers.num_splits > 1
        return DecodeMetadata(
            buffers.kv_lens,
            buffers.page_table,
            buffers.num_splits,
            buffers.partial_out if split else None,
            buffers.partial_lse if split else None,
        )

    def prepare_decode_into(self, batch: Batch, buffers: DecodeBuffers) -> TritonMetadata:
        """Copy `batch`'s decodes (its first num_decodes sequences and tokens; prefill chunks
        after them are not this bucket's) into a bucket's static buffers (device-to-device
        copies, no host sync); rows past them become padding: kv_len 0 (output zeros) and
        slot -1 (no store). The model's input rows past them are the caller's to pad."""
        fill_decode_bucket(batch, buffers)
        return self.decode_metadata(buffers)

    def prefill_buffers(
        self, tokens: int, seqs: int, max_pages: int, decodes: int = 0
    ) -> PrefillBuffers:
        """Static metadata for a bucket of steps of up to `tokens` tokens: up to `decodes`
        decodes (0: none, no decode section), then up to `seqs` prefill chunks, of sequences
        of at most `max_pages` pages; empty: every token padding."""
        if tokens < 1 or seqs < 1 or max_pages < 1 or not 0 <= decodes <= tokens:
            raise ValueError(
                f"a prefill bucket needs tokens, sequences, pages and at most one decode a "
                f"token, got {tokens} x {seqs} x {max_pages}, {decodes} decodes"
            )
        dev = self.device
        slots = torch.full((tokens,), -1, dtype=INDEX_DTYPE, device=dev)
        decode = None
        if decodes:
            decode = self.decode_buffers(decodes, max_pages, slot_mapping=slots[:decodes])
        return PrefillBuffers(
            slot_mapping=slots,
            decode=decode,
            query_start=torch.zeros(seqs + 1, dtype=INDEX_DTYPE, device=dev),
            kv_lens=torch.zeros(seqs, dtype=INDEX_DTYPE, device=dev),
            page_table=torch.zeros(seqs, max_pages, dtype=INDEX_DTYPE, device=dev),
        )

    def prefill_metadata(self, buffers: PrefillBuffers) -> TritonMetadata:
        """Metadata naming only `buffers`' tensors: what a prefill graph is captured with."""
        decode = None if buffers.decode is None else self._decode_section(buffers.decode)
        prefill = PrefillMetadata(
            0, buffers.tokens, buffers.query_start, buffers.kv_lens, buffers.page_table
        )
        return TritonMetadata(buffers.slot_mapping, decode, prefill)

    def prepare_prefill_into(self, batch: Batch, buffers: PrefillBuffers) -> TritonMetadata:
        """Copy a step that carries prefill chunks into a bucket's static buffers
        (device-to-device copies, no host sync): its decodes into the decode section, its
        chunks' query starts, lengths and page tables after them, every token's slot. Tokens
        past the step's get slot -1, decode rows past its kv_len 0 (zeros out, no key read),
        sequences past its no tokens (no program), so padding stores nothing. The model's input
        rows past the step's are the caller's to pad."""
        nd = batch.num_decodes
        s, t = batch.num_seqs - nd, batch.num_tokens
        width = batch.page_table.shape[1]
        rows = 0 if buffers.decode is None else buffers.decode.rows
        if nd > rows or t > buffers.tokens or s > buffers.seqs or width > buffers.max_pages:
            raise ValueError(
                f"{nd} decodes and {s} prefill chunks of {t} tokens x {width} pages do not fit "
                f"a bucket of {rows} decodes and {buffers.seqs} chunks in {buffers.tokens} "
                f"tokens x {buffers.max_pages} pages"
            )
        if buffers.decode is not None:
            copy_decodes(batch, buffers.decode)
        buffers.slot_mapping[:t].copy_(batch.slot_mapping)
        buffers.slot_mapping[t:].fill_(-1)
        buffers.query_start[: s + 1].copy_(batch.query_start[nd:])
        buffers.query_start[s + 1 :].fill_(t)
        buffers.kv_lens[:s].copy_(batch.kv_lens[nd:])
        buffers.kv_lens[s:].zero_()
        buffers.page_table[:s, :width].copy_(batch.page_table[nd:])
        return self.prefill_metadata(buffers)

    def _splits(self, rows: int, max_kv_len: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return choose_num_splits(rows, self.num_kv_heads, max_kv_len, self.num_sms)

    def _partials(self, rows: int, splits: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views of the backend's split-KV scratch for `rows` rows (None with one split)."""
        if splits == 1:
            return None, None
        out_shape, lse_shape = partial_shapes(rows, self.num_heads, splits, self.head_dim)
        n_out = rows * self.num_heads * splits * self.head_dim
        n_lse = rows * self.num_heads * splits
        if self._scratch.numel() < n_out + n_lse:
            with torch.inference_mode(False):  # a normal tensor, whoever first grows it
                self._scratch = torch.empty(
                    2 * (n_out + n_lse), dtype=torch.float32, device=self.device
                )
        return (
            self._scratch[:n_out].view(out_shape),
            self._scratch[n_out : n_out + n_lse].view(lse_shape),
        )

    # -- the per-layer calls -------------------------------------------------------------
    def store_kv(
        self,
        layer: int,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        metadata: TritonMetadata,
    ) -> None:
        k_cache, v_cache = self.kv[layer]
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)

    def rope_store_kv(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        rope: Rope,
        metadata: TritonMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            q, k = rope.apply(q, k)
            self.store_kv(layer, k, v, metadata)
            return q, k
        k_cache, v_cache = self.kv[layer]
        rope_store_kv(
            q, k, v, k_cache, v_cache, metadata.slot_mapping, rope.positions, rope.inv_freq
        )
        return q, k

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]: already in the pool (store_kv); not read here
        v: torch.Tensor,  # [T, Hkv, D]
        metadata: TritonMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        k_cache, v_cache = self.kv[layer]
        out = torch.empty_like(q)
        # Decodes first: a graph's decode section may reach into the chunks' rows (zeros
        # there), which the prefill kernel, queued after it, then writes.
        d = metadata.decode
        if d is not None:
            rows = d.rows
            paged_decode(
                q[:rows],
                k_cache,
                v_cache,
                d.page_table,
                d.kv_lens,
                out[:rows],
                self.scale,
                d.num_splits,
                d.partial_out,
                d.partial_lse,
            )
        p = metadata.prefill
        if p is not None:
            paged_prefill(
                q,
                k_cache,
                v_cache,
                p.page_table,
                p.kv_lens,
                p.query_start,
                p.first_seq,
                p.max_tokens,
                out,
                self.scale,
            )
        return out
