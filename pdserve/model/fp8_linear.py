"""A linear layer whose weight stays fp8: DeepSeek's block-quantised checkpoints served as they
are stored (`--quantization fp8`, model/fp8_weights.py chooses which layers).

The weight is float8_e4m3fn [O, K] with float32 block scales `weight_scale_inv`
[ceil(O / 128), ceil(K / 128)] (the checkpoint's own names); a call quantises its input per
token-group of 128 and multiplies through the block-scaled product (kernels/fp8_blocks.py
says the numerics; kernels/ops.py `fp8_linear` picks the Triton kernel on CUDA, the torch
reference elsewhere). `pow2_scales`: the input's group scales rounded up to powers of two, as
DeepSeek quantises activations for its ue8m0 checkpoints (V3.1, V3.2). Half the weight bytes
of bf16 are read each step, which is what a memory-bound decode step pays for.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import ops
from pdserve.kernels.fp8_blocks import BLOCK, FP8_DTYPE


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The block scales of an fp8 weight [rows, cols]."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


class Fp8Linear(nn.Module):
    """y = x @ W.T for an fp8 W (no bias: DeepSeek's quantised layers have none)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device,
        pow2_scales: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pow2_scales = pow2_scales
        weight = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        blocks = scale_shape(out_features, in_features)
        scale = torch.empty(blocks, dtype=torch.float32, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [O, K] e4m3
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)  # [O / 128, K / 128]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., O]
        flat = x.reshape(-1, self.in_features)
        out = ops.fp8_linear(flat, self.weight, self.weight_scale_inv, self.pow2_scales)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks, "
            f"pow2_scales={self.pow2_scales}"
        )
