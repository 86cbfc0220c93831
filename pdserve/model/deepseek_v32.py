"""DeepSeek-V3.2 (HF's DeepseekV32ForCausalLM): DeepSeek-V3 whose every attention layer attends
only to the keys its lightning indexer picks (DeepSeek Sparse Attention).

Everything but the attention mask is V3's (model/deepseek_v3.py: latent attention, experts,
YaRN). Per layer and step (HF's order of results, HF's numerics):
  1. MLA stores this step's latents and gathers each sequence's causal context (model/mla.py);
  2. the indexer's keys of the new tokens (`Indexer.keys`, from the same normed input x and
     MLA's rope tables) are stored into the layer's index-K buffers, then gathered;
  3. the indexer scores each new token's causal keys in float32 from `q_resid` (MLA's
     q_a_layernorm(q_a_proj(x))) and picks its `index_topk` best (all while it has fewer);
  4. MLA's expanded attention masks every key not picked (finfo.min before the float32
     softmax, exactly as HF's eager/sdpa path folds its top-k into the mask).
On a backend that decodes absorbed (the `triton` backend of a latent pool) a step of decodes
instead stores its index keys, scores each row's paged index-K and picks its top-k on the
device (attention/triton_index_scores.py), and attends absorbed over the picked latents only
(`absorbed`): the same keys, no gather, CUDA-graph safe.
Index-K's storage mode is read from the pool (`buffer_dtype`), never assumed: the model dtype
(HF parity), or fp8 e4m3 with a float32 scale per token (`--index-k-dtype fp8`,
model/dsa_indexer.py), so a layout and the model cannot disagree about it (LESSONS #11).
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.attention.backend import CausalContext, GatherBackend, LatentDecodeBackend
from pdserve.model.config import ModelArch
from pdserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.model.dsa_indexer import FLOAT32_PARAMS as INDEXER_FLOAT32
from pdserve.model.dsa_indexer import (
    FP8_DTYPE,
    KEY_BUFFER,
    SCALE_BUFFER,
    Indexer,
    IndexerArch,
    IndexKMode,
    index_k_for_cache,
)
from pdserve.model.mla import MLAttention
from pdserve.model.moe import FLOAT32_PARAMS as ROUTER_FLOAT32
from pdserve.parallel.group import RankGroup


def indexer_arch(arch: ModelArch) -> IndexerArch:
    assert arch.mla is not None and arch.dsa is not None
    if arch.mla.q_lora_rank is None:  # model/config.py refuses such a config first
        raise ValueError("DeepSeek-V3.2's indexer needs q_lora_rank")
    return IndexerArch(
        hidden_size=arch.hidden_size,
        q_lora_rank=arch.mla.q_lora_rank,
        n_heads=arch.dsa.index_n_heads,
        head_dim=arch.dsa.index_head_dim,
        rope_dim=arch.mla.qk_rope_head_dim,
        topk=arch.dsa.index_topk,
    )


class SparseMLAttention(MLAttention):
    """MLA plus its indexer (`self_attn.indexer.*`, HF's parameter names)."""

    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__(arch, layer_idx)
        self.indexer = Indexer(indexer_arch(arch))

    def index_k_mode(self, backend: GatherBackend) -> IndexKMode:
        fp8 = backend.buffer_dtype(self.layer_idx, KEY_BUFFER) == FP8_DTYPE
        return IndexKMode.FP8 if fp8 else IndexKMode.AUTO

    def absorbed(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's normed input
        q_resid: torch.Tensor | None,  # [T, q_lora_rank]
        q_nope: torch.Tensor,  # [T, H, N]
        q_rot: torch.Tensor,  # [T, H, P]: rotated
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LatentDecodeBackend,
        metadata: Any,
    ) -> torch.Tensor:  # [T, H, Dv]
        """A step of decodes, absorbed, over each row's top-k picks (module docstring)."""
        if q_resid is None:
            raise ValueError("DeepSeek-V3.2's indexer needs q_lora_rank")
        layer, mode = self.layer_idx, self.index_k_mode(backend)
        for name, values in index_k_for_cache(self.indexer.keys(x, cos, sin), mode).items():
            backend.store(layer, name, values, metadata)
        q, weights, qk_scale = self.indexer.scoring_query(x, q_resid, cos, sin, mode)
        picked = backend.index_topk(layer, q, weights, qk_scale, self.indexer.arch.topk, metadata)
        return self.attend_absorbed(q_nope, q_rot, backend, metadata, picked)

    def visible(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's normed input
        q_resid: torch.Tensor | None,  # [T, q_lora_rank]
        cos: torch.Tensor,  # [T, 1, P / 2]: MLA's tables, model dtype, YaRN included
        sin: torch.Tensor,
        backend: GatherBackend,
        metadata: Any,
        context: CausalContext,
    ) -> torch.Tensor:  # [B, Q, L] bool: the indexer's picks, within each token's causal keys
        if q_resid is None:
            raise ValueError("DeepSeek-V3.2's indexer needs q_lora_rank")
        layer, mode = self.layer_idx, self.index_k_mode(backend)
        # The quantised values (fp8 mode) are the model's to make: store never casts to fp8.
        for name, values in index_k_for_cache(self.indexer.keys(x, cos, sin), mode).items():
            backend.store(layer, name, values, metadata)
        keys = backend.gather(layer, KEY_BUFFER, metadata)
        scales = backend.gather(layer, SCALE_BUFFER, metadata) if mode is IndexKMode.FP8 else None
        return self.indexer(x, q_resid, cos, sin, keys, scales)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """Parameter names match HF checkpoints; the indexer's weights_proj stays float32 (HF's
    `_keep_in_fp32_modules`)."""

    FLOAT32_PARAMS = ROUTER_FLOAT32 + tuple(f"indexer.{p}" for p in INDEXER_FLOAT32)
    ATTENTION = SparseMLAttention

    def __init__(self, arch: ModelArch, group: RankGroup | None = None) -> None:
        if arch.dsa is None:
            raise ValueError(f"{arch.architecture} has no indexer: not a DeepSeek-V3.2 model")
        super().__init__(arch, group)
