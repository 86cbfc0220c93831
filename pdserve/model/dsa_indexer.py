"""DeepSeek-V3.2's lightning indexer (DSA): which of its causal keys each new token attends to.

Every V3.2 layer carries an indexer beside its MLA attention. Per token it caches one key,
"index-K" ([index_head_dim]: `wk`, LayerNorm, then NON-interleaved RoPE on the first
`rope_dim` dims, unlike MLA's interleaved RoPE). A new token scores every key of its causal
context in float32,

    score[t, s] = sum_h w[t, h] * relu(softmax_scale * q[t, h] . k[s]),
    w = weights_proj(hidden) * n_heads**-0.5,

and attends only to its `index_topk` best keys (all of them while the context is shorter).
The math mirrors HF transformers' `DeepseekV32Indexer` op for op, so keys, scores and choices
are exact against it (a decode step on the triton backend scores in a kernel of its own,
attention/triton_index_scores.py: equal to the last bits). The work is split as a paged server
needs it: `keys` gives the new tokens' index-K, which the model `store`s through the attention
seam like its latent; after `gather`, `forward` scores each new token over its sequence's
gathered keys and returns the [B, Q, L] selection that MLA's attention mask is ANDed with (HF:
non-selected keys get the masked value before the float32 softmax).

Two storage modes for index-K (`IndexKMode`, `--index-k-dtype auto|fp8`):
- AUTO: the model dtype; exact against HF.
- FP8: DeepSeek's own inference recipe (DeepSeek-V3.2-Exp inference/model.py and kernel.py,
  read for understanding, nothing copied): q and k are first rotated by an orthonormal
  Hadamard matrix, which leaves every dot product unchanged but spreads outlier channels so
  that one scale per vector loses little; each key is then stored as float8_e4m3fn with ONE
  float32 scale per token (its absmax / 448, the largest e4m3 value; their `act_quant` with
  block = index_head_dim = 128, so one block per token). Their released fp8 config sets
  scale_fmt "ue8m0", which rounds that scale UP to a power of two: dequantising is then an
  exact multiply. Queries are quantised the same way per (token, head), and the score is
  their fp8 kernel's form: relu(q8 . k8) times (w * q_scale * softmax_scale), summed over
  heads, times k_scale. Not exact against HF by design; the tests hold it to a plain float32
  reference on the same dequantised values.

Ties: with few heads many keys score exactly 0.0 (every head's ReLU clipped), and which of
them fills the last top-k places is up to `torch.topk` internals. `select` breaks ties by the
lower key index (a stable sort), so it is deterministic; with 16+ heads exact ties at the cut
vanish in practice and HF's choice equals ours.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kvcache import layout
from pdserve.kvcache.layout import INDEX_K as KEY_BUFFER
from pdserve.kvcache.layout import INDEX_K_SCALE as SCALE_BUFFER
from pdserve.kvcache.layout import BufferSpec
from pdserve.model.mla import rotate

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # DeepSeek's floor on a vector's absmax, so an all-zero key gets a finite scale
# Parameters HF keeps in float32 in a bf16 model (`_keep_in_fp32_modules`): the loader must too.
FLOAT32_PARAMS = ("weights_proj.weight",)


class IndexKMode(enum.Enum):
    """How index-K is stored: the model dtype (HF parity) or fp8 with a per-token scale."""

    AUTO = "auto"
    FP8 = "fp8"


@dataclass(frozen=True)
class IndexerArch:
    hidden_size: int
    q_lora_rank: int  # the indexer's queries come from MLA's q_a_layernorm(q_a_proj(x))
    n_heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    rope_dim: int  # qk_rope_head_dim: RoPE on the first rope_dim dims of q and k
    topk: int  # index_topk

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"IndexerArch.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(
                f"IndexerArch.rope_dim must be even and in (0, head_dim={self.head_dim}], "
                f"got {self.rope_dim}"
            )

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> IndexerArch:
        """From an HF DeepSeek-V3.2 config.json dict."""
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            q_lora_rank=int(cfg["q_lora_rank"]),
            n_heads=int(cfg["index_n_heads"]),
            head_dim=int(cfg["index_head_dim"]),
            rope_dim=int(cfg["qk_rope_head_dim"]),
            topk=int(cfg["index_topk"]),
        )


# -- fp8 storage -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:  # [d, d] float32, orthonormal
    if d < 1 or d & (d - 1):
        raise ValueError(f"fp8 index-K needs a power-of-two index_head_dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * d**-0.5).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D] float32
    """x times an orthonormal Hadamard matrix: dot products between rotated vectors are
    unchanged, outliers are spread over every channel (what makes one scale per key enough)."""
    return x.float() @ _hadamard(x.shape[-1], x.device)


def _fp8_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    scale = amax.float().clamp(min=AMAX_FLOOR) / FP8_MAX
    if not pow2:
        return scale
    # ue8m0: round up to a power of two. frexp gives scale = m * 2**e with m in [0.5, 1), so
    # scale is a power of two iff m == 0.5 (then it is 2**(e-1)), else the next one is 2**e.
    mantissa, exponent = torch.frexp(scale)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(scale), exponent)


def quantize_fp8(x: torch.Tensor, pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (float8_e4m3fn [..., D], float32 [...]): one scale per vector of D."""
    xf = x.float()
    scale = _fp8_scale(xf.abs().amax(dim=-1), pow2_scale)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_index_k(k: torch.Tensor, pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [T, D] (already rotated: `index_k_for_cache` does both) -> (fp8 [T, D], scale [T])."""
    if k.dim() != 2:
        raise ValueError(f"index keys must be [T, D], got {tuple(k.shape)}")
    return quantize_fp8(k, pow2_scale)


def dequantize_index_k(k_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(fp8 [T, D], scale [T] or [T, 1]) -> float32 [T, D] (the rotated keys, in fp8 mode)."""
    return k_fp8.float() * scale.reshape(-1, 1).float()


def index_k_buffers(
    mode: IndexKMode, head_dim: int, model_dtype: str, layers: tuple[int, ...] | None = None
) -> tuple[BufferSpec, ...]:
    """The KV-layout buffers the indexer adds to its layers: "index_k" [head_dim] of the model
    dtype; or, in fp8 mode, "index_k" float8_e4m3fn plus "index_k_scale" float32 [1]
    (defined once, in kvcache/layout.py, which builds a V3.2 pool from them)."""
    return layout.index_k_buffers(mode.value, head_dim, model_dtype, layers)


def index_k_for_cache(k: torch.Tensor, mode: IndexKMode) -> dict[str, torch.Tensor]:
    """The new tokens' keys [T, D] (from `Indexer.keys`) as the per-token values of the
    layer's index buffers, by buffer name, shaped [T, *spec.shape]."""
    if mode is IndexKMode.AUTO:
        return {KEY_BUFFER: k}
    k_fp8, scale = quantize_index_k(hadamard_rotate(k))
    return {KEY_BUFFER: k_fp8, SCALE_BUFFER: scale[:, None]}


# -- scoring and selection -------------------------------------------------------------------
class GatheredKeys(Protocol):
    """One index buffer's causal context as the attention seam's `gather` returns it
    (attention/backend.py CausalContext): B sequences, at most Q new tokens and L keys each."""

    @property
    def values(self) -> torch.Tensor: ...  # [B, L, *buffer shape]; padding past each kv_len

    @property
    def mask(self) -> torch.Tensor: ...  # [B, Q, L] bool: query slot (b, q) sees key l

    def pad(self, x: torch.Tensor) -> torch.Tensor: ...  # [T, ...] -> [B, Q, ...]


class Indexer(nn.Module):
    """Parameter names are HF's (`...self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`)."""

    def __init__(self, arch: IndexerArch) -> None:
        super().__init__()
        self.arch = arch
        self.wq_b = nn.Linear(arch.q_lora_rank, arch.n_heads * arch.head_dim, bias=False)
        self.wk = nn.Linear(arch.hidden_size, arch.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(arch.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(arch.hidden_size, arch.n_heads, bias=False)
        self.softmax_scale = arch.head_dim**-0.5

    def keys(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the layer's normed input (what MLA gets)
        cos: torch.Tensor,  # [T, 1, rope_dim / 2]: MLA's rope tables, model dtype
        sin: torch.Tensor,
    ) -> torch.Tensor:  # [T, head_dim], model dtype: the new tokens' index-K
        a = self.arch
        k = self.k_norm(self.wk(hidden))
        k_rot, k_pass = k.split([a.rope_dim, a.head_dim - a.rope_dim], -1)
        return torch.cat((rotate(k_rot[:, None], cos, sin, interleave=False)[:, 0], k_pass), dim=-1)

    def queries(
        self,
        q_resid: torch.Tensor,  # [T, q_lora_rank]: MLA's q_a_layernorm(q_a_proj(hidden))
        cos: torch.Tensor,  # [T, 1, rope_dim / 2]
        sin: torch.Tensor,
    ) -> torch.Tensor:  # [T, n_heads, head_dim], model dtype
        a = self.arch
        q = self.wq_b(q_resid).view(-1, a.n_heads, a.head_dim)
        q_rot, q_pass = q.split([a.rope_dim, a.head_dim - a.rope_dim], -1)
        return torch.cat((rotate(q_rot, cos, sin, interleave=False), q_pass), dim=-1)

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, n_heads] float32
        """Per-head score weights, n_heads**-0.5 included. HF keeps weights_proj in float32 and
        feeds it float32 activations; the upcasts keep that true in a bf16 model."""
        w = F.linear(hidden.float(), self.weights_proj.weight.float())
        return w * self.arch.n_heads**-0.5

    def scoring_query(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        q_resid: torch.Tensor,  # [T, q_lora_rank]
        cos: torch.Tensor,
        sin: torch.Tensor,
        mode: IndexKMode,
    ) -> tuple[torch.Tensor, torch.Tensor, float]:  # q [T, H, D] f32, weights [T, H] f32, scale
        """`scores`' query side for a kernel that computes, per key s,
        k_scale[s] * sum_h weights[h] * relu(scale * q[h] . k[s])
        (attention/triton_index_scores.py): the model-dtype form as is; the fp8 form's query
        rotated and quantised, its scale and the softmax scale folded into the weights."""
        q, w = self.queries(q_resid, cos, sin), self.head_weights(hidden)
        if mode is IndexKMode.AUTO:
            return q.float(), w, self.softmax_scale
        q_fp8, q_scale = quantize_fp8(hadamard_rotate(q))  # [T, H, D], [T, H]
        return q_fp8.float(), w * q_scale * self.softmax_scale, 1.0

    def scores(
        self,
        q: torch.Tensor,  # [B, Q, n_heads, head_dim]: `queries`, padded
        weights: torch.Tensor,  # [B, Q, n_heads] float32: `head_weights`, padded
        keys: torch.Tensor,  # [B, L, head_dim]: model dtype, or fp8 with key_scales
        causal: torch.Tensor,  # [B, Q, L] bool
        key_scales: torch.Tensor | None = None,  # [B, L] float32: fp8 mode
    ) -> torch.Tensor:  # [B, Q, L] float32, -inf outside each token's causal context
        if key_scales is None:
            # HF's shapes and op order, so the same bits: [B, Q, H, D] @ [B, 1, D, L], scaled,
            # ReLU, then the head-weighted sum as [B, Q, 1, H] @ [B, Q, H, L].
            k_t = keys.float().transpose(1, 2)[:, None]
            logits = F.relu(torch.matmul(q.float(), k_t) * self.softmax_scale)
            s = torch.matmul(weights[:, :, None, :], logits)[:, :, 0]
        else:
            # DeepSeek's fp8 form: the rotated query quantised per (token, head); its scale and
            # the softmax scale fold into the head weights; the key scale scales the head sum.
            q_fp8, q_scale = quantize_fp8(hadamard_rotate(q))  # [B, Q, H, D], [B, Q, H]
            k_t = keys.float().transpose(1, 2)[:, None]  # fp8 values are exact in float32
            logits = F.relu(torch.matmul(q_fp8.float(), k_t))  # [B, Q, H, L]
            folded = weights * q_scale * self.softmax_scale  # [B, Q, H]
            s = (logits * folded[..., None]).sum(dim=2) * key_scales.float()[:, None, :]
        # masked_fill, not an add: padding keys may hold anything (fp8 NaN bytes included)
        return s.masked_fill(~causal, float("-inf"))

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        q_resid: torch.Tensor,  # [T, q_lora_rank]
        cos: torch.Tensor,  # [T, 1, rope_dim / 2]
        sin: torch.Tensor,
        keys: GatheredKeys,  # gather(layer, "index_k"), after this step's keys were stored
        scales: GatheredKeys | None = None,  # gather(layer, "index_k_scale"): fp8 mode
    ) -> torch.Tensor:  # [B, Q, L] bool: the keys each new token attends to (within causal)
        q = keys.pad(self.queries(q_resid, cos, sin))
        w = keys.pad(self.head_weights(hidden))
        key_scales = None if scales is None else scales.values.reshape(scales.values.shape[:2])
        s = self.scores(q, w, keys.values, keys.mask, key_scales)
        return select(s, keys.mask, self.arch.topk)


def select(
    scores: torch.Tensor,  # [..., L] float32
    causal: torch.Tensor,  # [..., L] bool: the keys each token may see
    topk: int,
) -> torch.Tensor:  # [..., L] bool: the chosen keys, a subset of `causal`
    """Each token's `topk` best causal keys; all of them while it has at most `topk`. Equal
    scores go to the lower key index (a stable sort), never to a kernel's internals."""
    if topk < 1:
        raise ValueError(f"index_topk must be >= 1, got {topk}")
    ranked = scores.masked_fill(~causal, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros_like(causal).scatter_(-1, order[..., :topk], True)
    return chosen & causal
