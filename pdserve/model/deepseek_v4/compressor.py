"""V4's compressors: each closed window of `ratio` tokens becomes one KV entry, and CSA's
lightning indexer picks which entries each query sees.

A compressor projects every token to a kv row and a gate row; when a window closes, its entry
is the window's kv rows averaged with softmax(gate + position_bias) weights (per channel, over
the window, float32), RMS-normed, and rotated by the compress table at the position of the
window's first token. Entry w covers positions w*ratio .. (w+1)*ratio - 1, and query p sees it
once its window has closed: w < (p + 1) // ratio.

  * HCA (HF's DeepseekV4HCACompressor, ratio 128): head_dim-wide rows, one window per entry.
  * CSA (DeepseekV4CSACompressor, ratio 4) projects 2 * head_dim: series Ca (first half) and
    Cb (second half). Entry w pools window w-1's Ca with window w's Cb (2 * ratio rows); entry
    0 has no window before it (its Ca slots weigh 0).
  * CSA's indexer (DeepseekV4Indexer) is such an overlapping compressor at index_head_dim, plus
    queries from the attention's q latent and per-head weights:
        score[t, w] = sum_h w[t, h] * relu(q[t, h] . k[w]) * index_head_dim**-0.5
    in float32; each query keeps its `index_topk` best visible entries (all, while fewer).

State, per sequence (kvcache/v4_layout.py; which rows hold data follows from `start`):
  * the tail: kv and gate rows (pre-bias, model dtype) of the tokens after the last closed
    window, row position % ratio, start % ratio of them;
  * CSA's overlap: the last closed window's Ca rows and their biased float32 gates, valid once
    a window closed before this step (start // ratio >= 1);
  * the entries themselves, paged: this step appends entries start // ratio onwards, in the
    model dtype or, where the pool says so, fp8 (kv_quant.py: an entry's rotary part stays in
    the model dtype; the indexer's keys are quantised whole).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kvcache import v4_layout as names
from pdserve.model.deepseek_v4 import kv_quant
from pdserve.model.deepseek_v4.config import V4Arch
from pdserve.model.deepseek_v4.kv import SeqKV
from pdserve.model.deepseek_v4.kv_quant import Fp8Form
from pdserve.model.deepseek_v4.norm import RMSNorm
from pdserve.model.deepseek_v4.rope import Angles, RopeTable
from pdserve.model.dsa_indexer import select


class Components(NamedTuple):
    """The KV components one compressor owns (kvcache/v4_layout.py's names)."""

    tail_kv: str
    tail_gate: str
    entries: str
    overlap_kv: str | None = None  # overlapping (CSA) compressors only
    overlap_gate: str | None = None
    page_overlap_kv: str | None = None  # the overlap at each page's end
    page_overlap_gate: str | None = None


HCA_PARTS = Components(names.HCA_TAIL_KV, names.HCA_TAIL_GATE, names.HCA_KV)
CSA_PARTS = Components(
    names.CSA_TAIL_KV, names.CSA_TAIL_GATE, names.CSA_KV,
    names.CSA_OVERLAP_KV, names.CSA_OVERLAP_GATE,
    names.PAGE_OVERLAP_KV, names.PAGE_OVERLAP_GATE,
)  # fmt: skip
INDEX_PARTS = Components(
    names.INDEX_TAIL_KV, names.INDEX_TAIL_GATE, names.CSA_INDEX_K,
    names.INDEX_OVERLAP_KV, names.INDEX_OVERLAP_GATE,
    names.PAGE_INDEX_OVERLAP_KV, names.PAGE_INDEX_OVERLAP_GATE,
)  # fmt: skip


def entry_form(arch: V4Arch) -> Fp8Form:
    """An attention entry in fp8: the rotary channels kept, the rest in 64-channel blocks."""
    return Fp8Form(arch.compress_rope.dim, names.KV_SCALE_BLOCK)


class IndexInputs(NamedTuple):
    kv: torch.Tensor  # [T, 2 * index_head_dim]
    gate: torch.Tensor
    q: torch.Tensor  # [T, index_n_heads, index_head_dim], rotated
    weights: torch.Tensor  # [T, index_n_heads] float32, index_n_heads**-0.5 included


class Projected(NamedTuple):
    """A step's compressor inputs for all its tokens (projections run batched)."""

    kv: torch.Tensor  # [T, width]
    gate: torch.Tensor  # [T, width]
    indexer: IndexInputs | None = None  # CSA: the indexer's


class Compressor(nn.Module):
    """The pooling part shared by HCA (overlap=False) and CSA and its indexer (overlap=True);
    parameter names are HF's (kv_proj, gate_proj, position_bias, kv_norm). `fp8`: how its
    entries are stored where the pool keeps them in fp8."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        ratio: int,
        overlap: bool,
        eps: float,
        parts: Components,
        fp8: Fp8Form,
    ) -> None:
        super().__init__()
        width = (2 if overlap else 1) * head_dim
        self.head_dim, self.ratio, self.overlap, self.parts = head_dim, ratio, overlap, parts
        self.fp8 = fp8
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, angles: Angles) -> Projected:
        """x [T, hidden]; q_resid and angles (compress table) serve CSA's indexer."""
        return Projected(self.kv_proj(x), self.gate_proj(x))

    def context(
        self,
        p: Projected,
        rows: slice,
        seq: SeqKV,
        start: int,
        table: RopeTable,
        resumes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's new tokens (`rows` of the step, positions start ..): its entries
        after this step [E, head_dim] and which each query sees [n, E] bool. `resumes`: its
        state is first rebuilt from the page ending at `start` (a cached prefix)."""
        entries = self.update(p.kv[rows], p.gate[rows], seq, start, table, resumes)
        return entries, self.closed(start, p.kv[rows].shape[0], entries.shape[0])

    def closed(self, start: int, n: int, count: int) -> torch.Tensor:  # [n, count] bool
        """Query start + i sees entry w iff w's window has closed by then."""
        device = self.position_bias.device
        seen = (torch.arange(start, start + n, device=device) + 1) // self.ratio
        return torch.arange(count, device=device)[None, :] < seen[:, None]

    def update(
        self,
        kv: torch.Tensor,  # [n, width]: the sequence's new tokens, positions start ..
        gate: torch.Tensor,  # [n, width]
        seq: SeqKV,
        start: int,
        table: RopeTable,
        resumes: bool = False,
    ) -> torch.Tensor:  # [E, head_dim]: every entry of the sequence after this step
        r, parts = self.ratio, self.parts
        if resumes and parts.page_overlap_kv is not None:
            # At a page boundary the tail is empty; the overlap is the page's end's.
            assert parts.overlap_kv is not None and parts.overlap_gate is not None
            assert parts.page_overlap_gate is not None
            every = seq.row_tokens(parts.page_overlap_kv)
            if start % every:
                raise ValueError(f"a resume at {start} is not at a page's end")
            page = start // every - 1
            for state, kept in ((parts.overlap_kv, parts.page_overlap_kv),
                                (parts.overlap_gate, parts.page_overlap_gate)):  # fmt: skip
                seq.write_state(state, slice(None), seq.row(kept, page))
        held = start % r  # tail rows from earlier steps: positions start - held .. start - 1
        if held:
            kv = torch.cat((seq.state(parts.tail_kv)[:held], kv))
            gate = torch.cat((seq.state(parts.tail_gate)[:held], gate))
        windows, first = kv.shape[0] // r, start // r
        cut = windows * r
        if windows:
            shape = (windows, r, -1)
            pooled = self.pool(kv[:cut].view(shape), gate[:cut].view(shape), seq, first)
            positions = (torch.arange(windows, device=kv.device) + first) * r
            rotated = table.at(positions, pooled.dtype).rotate(pooled)
            kv_quant.store_rows(seq, parts.entries, first, rotated, self.fp8)
        if kv.shape[0] > cut:  # the new tail, from row 0 (its window starts at a multiple of r)
            seq.write_state(parts.tail_kv, slice(0, kv.shape[0] - cut), kv[cut:])
            seq.write_state(parts.tail_gate, slice(0, kv.shape[0] - cut), gate[cut:])
        return kv_quant.rows(seq, parts.entries, first + windows, self.fp8, kv.dtype)

    def pool(
        self,
        kv: torch.Tensor,  # [m, ratio, width]: m closed windows, the first is entry `first`
        gate: torch.Tensor,  # [m, ratio, width], pre-bias
        seq: SeqKV,
        first: int,
    ) -> torch.Tensor:  # [m, head_dim]: the windows' entries, normed, not rotated
        gate = gate + self.position_bias  # float32, as HF adds its float32 bias
        if self.overlap:
            kv, gate = self.overlapped(kv, gate, seq, first)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=1))

    def overlapped(
        self, kv: torch.Tensor, gate: torch.Tensor, seq: SeqKV, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [m, 2 * ratio, head_dim] each
        """Each window's slots: the previous window's Ca rows, then its own Cb rows. The
        previous window of the step's first is the overlap state's (zero weight for entry 0);
        this step's last window's Ca becomes the new overlap state."""
        d, r, m = self.head_dim, self.ratio, kv.shape[0]
        assert self.parts.overlap_kv is not None and self.parts.overlap_gate is not None
        both_kv = kv.new_zeros(m, 2 * r, d)
        both_gate = gate.new_full((m, 2 * r, d), float("-inf"))
        both_kv[:, r:], both_gate[:, r:] = kv[..., d:], gate[..., d:]
        both_kv[1:, :r], both_gate[1:, :r] = kv[:-1, :, :d], gate[:-1, :, :d]
        overlap_kv = seq.state(self.parts.overlap_kv)  # [ratio, d], model dtype
        overlap_gate = seq.state(self.parts.overlap_gate)  # [ratio, d] float32, biased
        if first >= 1:
            both_kv[0, :r] = overlap_kv.to(both_kv.dtype)
            both_gate[0, :r] = overlap_gate.to(both_gate.dtype)
        kept_kv, kept_gate = self.parts.page_overlap_kv, self.parts.page_overlap_gate
        if kept_kv is not None and kept_gate is not None and seq.buffer_dtype(kept_kv) is not None:
            # Each page's end keeps its overlap (a pool with a prefix cache).
            every = seq.row_tokens(kept_kv)
            for j in range(m):
                end = (first + j + 1) * r
                if end % every == 0:
                    seq.store_rows(kept_kv, end // every - 1, kv[j, :, :d][None])
                    seq.store_rows(kept_gate, end // every - 1, gate[j, :, :d][None])
        seq.write_state(self.parts.overlap_kv, slice(None), kv[-1, :, :d])
        seq.write_state(self.parts.overlap_gate, slice(None), gate[-1, :, :d])
        return both_kv, both_gate


class HeavyCompressor(Compressor):
    """HCA's (HF's DeepseekV4HCACompressor): hca_ratio tokens per entry, no overlap."""

    def __init__(self, arch: V4Arch) -> None:
        h, d, eps = arch.hidden_size, arch.head_dim, arch.rms_norm_eps
        super().__init__(h, d, arch.hca_ratio, False, eps, HCA_PARTS, entry_form(arch))


class Scorer(nn.Module):
    """HF's DeepseekV4IndexerScorer's parameter: per-head weights of the indexer's score."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """HF's DeepseekV4Indexer: an overlapping compressor at index_head_dim (its keys), the
    queries' projection from the attention's q latent, and the scorer."""

    def __init__(self, arch: V4Arch) -> None:
        h, d, eps = arch.hidden_size, arch.index_head_dim, arch.rms_norm_eps
        whole = Fp8Form(0, d)  # in fp8, a key is quantised whole: one scale a row
        super().__init__(h, d, arch.csa_ratio, True, eps, INDEX_PARTS, whole)
        self.heads, self.topk = arch.index_n_heads, arch.index_topk
        self.q_b_proj = nn.Linear(arch.q_lora_rank, self.heads * d, bias=False)
        self.scorer = Scorer(h, self.heads)

    def inputs(self, x: torch.Tensor, q_resid: torch.Tensor, angles: Angles) -> IndexInputs:
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        q = angles.rotate(self.q_b_proj(q_resid).view(x.shape[0], self.heads, self.head_dim))
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5
        return IndexInputs(kv, gate, q, weights)

    def choose(
        self,
        q: torch.Tensor,  # [n, heads, index_head_dim]
        weights: torch.Tensor,  # [n, heads] float32
        keys: torch.Tensor,  # [E, index_head_dim]: the sequence's index entries
        visible: torch.Tensor,  # [n, E] bool: the closed entries
    ) -> torch.Tensor:  # [n, E] bool: each query's index_topk best (all, while fewer)
        # HF's op order: relu(q . k) scaled, then the weighted sum over heads, float32.
        scores = F.relu(torch.matmul(q.float(), keys.float().T)) * self.head_dim**-0.5
        scores = (scores * weights[..., None]).sum(dim=1)  # [n, E]
        return select(scores, visible, self.topk)


class SparseCompressor(Compressor):
    """CSA's (HF's DeepseekV4CSACompressor): overlapping windows of csa_ratio tokens, and the
    indexer that narrows each query's entries."""

    def __init__(self, arch: V4Arch) -> None:
        h, d, eps = arch.hidden_size, arch.head_dim, arch.rms_norm_eps
        super().__init__(h, d, arch.csa_ratio, True, eps, CSA_PARTS, entry_form(arch))
        self.indexer = Indexer(arch)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, angles: Angles) -> Projected:
        index = self.indexer.inputs(x, q_resid, angles)
        return Projected(self.kv_proj(x), self.gate_proj(x), index)

    def context(
        self,
        p: Projected,
        rows: slice,
        seq: SeqKV,
        start: int,
        table: RopeTable,
        resumes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        entries, visible = super().context(p, rows, seq, start, table, resumes)
        ix = p.indexer
        assert ix is not None
        keys = self.indexer.update(ix.kv[rows], ix.gate[rows], seq, start, table, resumes)
        return entries, self.indexer.choose(ix.q[rows], ix.weights[rows], keys, visible)
