"""A counter-based random stream: a request's noise at output position i is a pure function of
(seed, i) and the token id, whatever else is in the batch and whichever worker samples it.

Two levels. On the host, `row_key(seed, position)` is the position-th output of SplitMix64
started from a mix of the seed: exact Python integers, O(1) per row per step. On the device,
`gumbel_noise(keys, vocab)` hashes (key, token id) into one 32-bit integer per element with a
keyed integer hash (xor-shift / odd-multiply rounds, as in the well-known "lowbias32" mixers),
then maps it to a Gumbel(0, 1) value. The hash runs on int64 tensors holding 32-bit values,
and every product is of a value below 2**32 with a constant below 2**31, so nothing overflows
int64: the integers are the same on CPU and CUDA, bit for bit, in any batch.

The integer `m` becomes w = (m + 1) / 2**32 in (0, 1], E = -log(1 - w) ~ Exp(1) and
g = -log(E) ~ Gumbel(0, 1). The winning tokens are those with small E, i.e. small w, where a
float32 keeps 24 significant bits at any magnitude, so the tail of g is resolved finely (a
w of 1 gives E = inf, g = -inf: that token cannot win this draw, which at probability 2**-25
it would not have anyway). These float steps are IEEE operations plus two logarithms, whose
last bit may differ between devices (and between the vectorised and scalar paths of one
CPU): a token changes only if two candidates' scores tie within that bit.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFF_FFFF
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
GOLDEN_GAMMA = 0x9E37_79B9_7F4A_7C15  # SplitMix64's increment: 2**64 / the golden ratio
# Odd multipliers below 2**31, so that a 32-bit value times one stays inside int64.
TOKEN_MUL = 0x2C1B_3C6D
MUL_1 = 0x7FEB_352D
MUL_2 = 0x5BD1_E995


def splitmix64(x: int) -> int:
    """SplitMix64's output function of state `x` + gamma: a bijective 64-bit mixer."""
    x = (x + GOLDEN_GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & MASK64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of the draw at output `position` of a request seeded `seed`.

    Seeds are taken modulo 2**64 (so -1 and 2**64 - 1 are one stream). The stream's state is
    mix(seed); the key at position i is SplitMix64's i-th output from it, so seeds that differ
    by a multiple of the gamma do not give shifted copies of each other's streams."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    state = splitmix64(seed & MASK64)
    return splitmix64((state + position * GOLDEN_GAMMA) & MASK64)


def split_key(key: int) -> tuple[int, int]:
    """A 64-bit key as its (low, high) 32-bit halves: both exact in a float64 or an int64."""
    return key & MASK32, key >> 32


def hash32(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """keys [R, 2] int64 (low, high halves), token_ids [1, V] or [R, V] int64 in [0, 2**31)
    -> [R, V] int64 in [0, 2**32): a keyed hash of each (row key, token id)."""
    x = torch.bitwise_and(token_ids * TOKEN_MUL, MASK32)  # [1|R, V]
    x = torch.bitwise_xor(x, keys[:, :1])  # [R, V]
    x.bitwise_xor_(x >> 16)
    x.mul_(MUL_1).bitwise_and_(MASK32)
    x.bitwise_xor_(keys[:, 1:])
    x.bitwise_xor_(x >> 15)
    x.mul_(MUL_2).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 16)
    return x


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R, 2] int64 -> [R, vocab] float32 Gumbel(0, 1) noise, one row per key."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    m = hash32(keys, ids).add_(1)  # [R, V] in [1, 2**32]
    neg_w = m.to(torch.float32).mul_(-(2.0**-32))  # -w, w in (0, 1]
    e = neg_w.log1p_().neg_()  # E = -log(1 - w) in (0, inf]
    return e.log_().neg_()  # g = -log(E)
