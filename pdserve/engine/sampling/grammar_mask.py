"""A step's grammar masks on the device, and their application to the logits.

`GrammarMask` holds, for the G constrained rows of a batch (engine/sampling/grammars.py
computes them on the host), each row's index and its bitmask: W int32 words, bit b of word w
set when token 32w + b is allowed. `apply_grammar_mask` sets every other logit of those rows
to -inf, after logit_bias and the penalties and before greedy or the draw (engine/sampler.py),
so a row without a grammar is not touched and a constrained row's token is always one its
grammar allows. Logits wider than the bitmask (a model's vocabulary padded past the
tokenizer's) are disallowed past it; a bitmask wider than the logits is cut to them.

The unpacking is a few elementwise tensor ops on the G rows only: the same code on CPU and
CUDA, outside the CUDA graphs (it runs on the graphed forward's logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class GrammarMask:
    rows: torch.Tensor  # [G] int64, rows of the batch
    bits: torch.Tensor  # [G, W] int32

    @classmethod
    def upload(cls, flat: torch.Tensor, g: int, words: int, device: torch.device) -> GrammarMask:
        """From the host buffer `flat` ([G * W] bitmask words, then the G row indices): one
        copy to `device` (non-blocking: `flat` is pinned on CUDA)."""
        if device.type != "cpu":
            flat = flat.to(device, non_blocking=True)
        return cls(flat[g * words :].long(), flat[: g * words].view(g, words))


def allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """bits [G, W] int32 -> [G, vocab] bool: token t allowed where bit t is set; tokens past
    32 W are not."""
    shifts = _SHIFTS.get(bits.device)
    if shifts is None:
        shifts = _SHIFTS[bits.device] = torch.arange(32, dtype=torch.int32, device=bits.device)
    out = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [G, 32 W]
    width = out.shape[1]
    if width >= vocab:
        return out[:, :vocab]
    return torch.nn.functional.pad(out, (0, vocab - width), value=False)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """In place on logits [N, V]: the masked rows' disallowed tokens become -inf."""
    sub = logits.index_select(0, mask.rows)  # [G, V]
    sub.masked_fill_(~allowed(mask.bits, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, mask.rows, sub)
