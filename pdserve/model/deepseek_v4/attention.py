"""V4's attention (HF's DeepseekV4Attention): one K=V head over a sliding window of tokens,
plus, in CSA and HCA layers, the compressor's entries.

Per layer and step, batched over the step's tokens: q from a low-rank path (q_a_proj, its norm,
q_b_proj, an unweighted per-head norm), the one K=V head (kv_proj, kv_norm), both rotated on
their trailing slice (the main table in sliding-only layers, compress in CSA/HCA), and the
compressor's projections. Then per sequence (the torch reference path):
  * the window: the ring holds K=V of positions < start (row position % sliding_window); the
    queries see keys in (p - sliding_window, p]; the new tokens' rows are written back after
    the ring is read;
  * the compressor's entries that each query sees (closed windows; CSA: the indexer's pick);
  * softmax over [window keys, entries, one per-head sink logit], float32 like HF's eager
    path (the sink takes probability mass, then is dropped), times the same K=V rows.
Then, batched again: the output rotated back by the query's angle (K=V carried the keys'
rotation into it), and the grouped low-rank output projection (o_groups groups of heads, each
projected by its own block of o_a_proj, mixed by o_b_proj).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kvcache.v4_layout import CSA, HCA, PAGE_RING, SWA_RING
from pdserve.model.deepseek_v4.compressor import Compressor, HeavyCompressor, SparseCompressor
from pdserve.model.deepseek_v4.config import V4Arch
from pdserve.model.deepseek_v4.kv import SeqKV, StepKV
from pdserve.model.deepseek_v4.norm import RMSNorm, unweighted_rms_norm
from pdserve.model.deepseek_v4.rope import StepRope


class GroupedLinear(nn.Module):
    """HF's DeepseekV4GroupedLinear: group g of the input through rows g*out/G .. of
    `weight` [out, in_per_group] (o_a_proj)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, in] -> [T, G, out / G]
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [G, in, out / G]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


class V4Attention(nn.Module):
    def __init__(self, arch: V4Arch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.kind = layer_idx, arch.layer_types[layer_idx]
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.window_size, self.eps = arch.sliding_window, arch.rms_norm_eps
        self.scale = arch.head_dim**-0.5
        h, r, heads_width = arch.hidden_size, arch.q_lora_rank, arch.num_heads * arch.head_dim
        self.q_a_proj = nn.Linear(h, r, bias=False)
        self.q_a_norm = RMSNorm(r, arch.rms_norm_eps)
        self.q_b_proj = nn.Linear(r, heads_width, bias=False)
        self.kv_proj = nn.Linear(h, arch.head_dim, bias=False)
        self.kv_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        groups = arch.o_groups
        self.o_a_proj = GroupedLinear(heads_width // groups, groups * arch.o_lora_rank, groups)
        self.o_b_proj = nn.Linear(groups * arch.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(arch.num_heads, dtype=torch.float32))
        self.compressor: Compressor | None = (
            SparseCompressor(arch)
            if self.kind == CSA
            else HeavyCompressor(arch)
            if self.kind == HCA
            else None
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's normed input
        rope: StepRope,
        kv: StepKV,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        angles = rope.compress if self.compressor is not None else rope.main
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [T, q_lora_rank]
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.head_dim)
        q = angles.rotate(unweighted_rms_norm(q, self.eps))  # [T, H, D]
        k = angles.rotate(self.kv_norm(self.kv_proj(x)))  # [T, D]: key and value
        projected = (
            None if self.compressor is None else self.compressor.project(x, q_resid, rope.compress)
        )
        out = torch.empty_like(q)
        for b, span in enumerate(kv.spans):
            seq = kv.seq(self.layer_idx, b)
            rows = slice(span.first, span.first + span.length)
            keys, visible = self.window(seq, k[rows], span.start, span.resumes)
            if self.compressor is not None:
                assert projected is not None
                entries, seen = self.compressor.context(
                    projected, rows, seq, span.start, rope.compress_table, span.resumes
                )
                keys = torch.cat((keys, entries.to(keys.dtype)))
                visible = torch.cat((visible, seen), dim=1)
            out[rows] = self.attend(q[rows], keys, visible)
        out = angles.rotate(out, sign=-1)  # undo the keys' rotation that V carried in
        grouped = self.o_a_proj(out.view(t, self.o_a_proj.groups, -1))  # [T, G, o_lora_rank]
        return self.o_b_proj(grouped.flatten(1))

    def window(
        self, seq: SeqKV, k: torch.Tensor, start: int, resumes: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys [P + n, D], visible [n, P + n]
        """The sliding window's keys for new tokens k [n, D] at positions start ..: the
        ring's last P = min(start, window - 1) positions, then the new ones; the ring then
        takes the new rows (the last `window` of them). `resumes`: the ring is first rebuilt
        from the page ending at `start` (a cached prefix). Each page this step completes keeps
        its last `window` rows (PAGE_RING), for a request that resumes there later."""
        w, n, device = self.window_size, k.shape[0], k.device
        ends_kept = seq.buffer_dtype(PAGE_RING) is not None  # with a prefix cache
        every = seq.row_tokens(PAGE_RING) if ends_kept else 0  # the page size
        if resumes:
            if not ends_kept or start % every or start < w:
                raise ValueError(f"a resume at {start} is not at a kept page's end")
            page = start // every - 1
            rows = torch.arange(start - w, start, device=device) % w
            seq.write_state(SWA_RING, rows, seq.row(PAGE_RING, page))
        ring = seq.state(SWA_RING)  # [window, D]
        past = min(start, w - 1)
        if past:
            keys = torch.cat((ring[torch.arange(start - past, start, device=device) % w], k))
        else:
            keys = k
        ends = range(-(-(start + 1) // every) * every, start + n + 1, every) if ends_kept else ()
        for end in ends:
            lo = end - w - (start - past)  # keys' row of position end - w
            seq.store_rows(PAGE_RING, end // every - 1, keys[lo : lo + w][None])
        kept = min(n, w)
        rows = torch.arange(start + n - kept, start + n, device=device) % w
        seq.write_state(SWA_RING, rows, k[n - kept :])
        key_pos = torch.arange(-past, n, device=device)[None, :]  # relative to start
        query_pos = torch.arange(n, device=device)[:, None]
        return keys, (key_pos <= query_pos) & (key_pos > query_pos - w)

    def attend(
        self,
        q: torch.Tensor,  # [n, H, D]
        keys: torch.Tensor,  # [L, D]: keys and values
        visible: torch.Tensor,  # [n, L] bool
    ) -> torch.Tensor:  # [n, H, D]
        logits = torch.matmul(q.transpose(0, 1), keys.T) * self.scale  # [H, n, L]
        logits = logits.masked_fill(~visible, float("-inf"))
        sinks = self.sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)  # [H, n, 1] float32
        logits = torch.cat((logits, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys).transpose(0, 1)
