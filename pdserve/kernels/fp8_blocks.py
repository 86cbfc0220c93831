"""fp8 block-scaled products, as DeepSeek's own inference multiplies its fp8 checkpoints: the
format and the torch reference (what the CPU runs, and what the Triton kernels equal).

A weight W [O, K] is stored as float8_e4m3fn with one float32 scale per BLOCK x BLOCK block:
W = W_q * S[o // BLOCK, k // BLOCK] (`weight_scale_inv` [ceil(O / B), ceil(K / B)], the last
blocks cut short). An activation row x [K] is quantised per group of BLOCK consecutive values
(`act_quant`): s = max(max|x_group|, MIN_AMAX) / FP8_MAX, x_q = x / s rounded to e4m3, one
float32 scale per group. With `pow2` (checkpoints whose quantization_config says "scale_fmt":
"ue8m0", DeepSeek-V3.1 and V3.2, as DeepSeek's act_quant does for them) s is then rounded up to
a power of two, 2**ceil(log2 s), by its bits (`pow2_ceil`: float log2 can be off by an ulp),
so a scale that is already one stays. The product of the two is accumulated one K block at a
time in float32, each block's partial sum scaled by its activation scale and its weight scale
before it is added:

    y[n, o] = sum_kb (x_q[n, kb] . W_q[o, kb]) * s_x[n, kb] * S[o // B, kb]

then rounded to the output dtype. The e4m3 products are exact in float32; only the sums round.
"""

from __future__ import annotations

import torch

BLOCK = 128  # DeepSeek's weight_block_size (both sides) and its activation group
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
MIN_AMAX = 1e-10  # an all-zero group gets this amax: a finite scale, zeros stay zeros
# float32's fields: the mantissa, the exponent, and the exponent's lowest bit (2x the value)
MANTISSA_BITS, EXPONENT_BITS, EXPONENT_ONE = 0x007FFFFF, 0x7F800000, 0x00800000


def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales (positive, normal: MIN_AMAX / FP8_MAX is) -> the power of two at or above
    each, exactly: one with mantissa bits set takes the next exponent and a zero mantissa; a
    power of two (and an inf or NaN: exponent all ones) stays."""
    bits = scale.view(torch.int32)
    up = ((bits & MANTISSA_BITS) != 0) & (bits < EXPONENT_BITS)
    return torch.where(up, (bits & EXPONENT_BITS) + EXPONENT_ONE, bits).view(torch.float32)


def act_quant(
    x: torch.Tensor, block: int = BLOCK, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] -> (x_q float8_e4m3fn [N, K], scales float32 [N, ceil(K / block)]): each group
    of `block` values (the last cut short, as the weight's last K block is) scaled so that its
    largest magnitude is FP8_MAX, or with `pow2` by that scale rounded up to a power of two
    (`pow2_ceil`: the largest magnitude then lies in (FP8_MAX / 2, FP8_MAX])."""
    n, k = x.shape
    kb = -(-k // block)
    groups = torch.zeros(n, kb * block, dtype=torch.float32, device=x.device)
    groups[:, :k] = x.float()
    groups = groups.view(n, kb, block)  # [N, KB, B]
    scale = groups.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX  # [N, KB]
    if pow2:
        scale = pow2_ceil(scale)
    q = (groups / scale.unsqueeze(-1)).to(FP8_DTYPE).view(n, kb * block)
    return q[:, :k].contiguous(), scale


def block_linear(
    x_q: torch.Tensor,  # [N, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [N, K / B] float32
    weight: torch.Tensor,  # [O, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [ceil(O / B), ceil(K / B)] float32
    out_dtype: torch.dtype,
    block: int = BLOCK,
) -> torch.Tensor:  # [N, O]
    """The block-scaled product (module docstring), one K block at a time in float32."""
    n, k = x_q.shape
    o = weight.shape[0]
    acc = torch.zeros(n, o, dtype=torch.float32, device=x_q.device)
    row_scale = weight_scale.float().repeat_interleave(block, 0)[:o]  # [O, KB]
    for kb in range(-(-k // block)):
        cols = slice(kb * block, (kb + 1) * block)
        part = x_q[:, cols].float() @ weight[:, cols].float().T  # [N, O], exact products
        acc += part * x_scale[:, kb : kb + 1] * row_scale[:, kb]
    return acc.to(out_dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, pow2: bool = False
) -> torch.Tensor:
    """x [N, K] (the model's dtype) @ the fp8 weight [O, K] -> [N, O] in x's dtype: the
    activation quantised per group (its scales powers of two with `pow2`), then the
    block-scaled product."""
    x_q, x_scale = act_quant(x, pow2=pow2)
    return block_linear(x_q, x_scale, weight, weight_scale, x.dtype)


def quantize_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, K] -> (float8_e4m3fn [O, K], float32 scales [ceil(O / B), ceil(K / B)]): DeepSeek's
    checkpoint format (what tests and generated checkpoints write)."""
    o, k = w.shape
    ob, kb = -(-o // block), -(-k // block)
    padded = torch.zeros(ob * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:o, :k] = w.float()
    tiles = padded.view(ob, block, kb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX  # [OB, KB]
    q = (tiles / scale[:, None, :, None]).to(FP8_DTYPE).view(ob * block, kb * block)
    return q[:o, :k].contiguous(), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The float32 weight [O, K] of an fp8 weight and its block scales."""
    o, k = q.shape
    return q.float() * scale.repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :k]
