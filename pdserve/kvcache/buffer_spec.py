"""One named KV buffer (`BufferSpec`): its per-token shape, dtype and layers, checked.

A KV layout (kvcache/layout.py) is a tuple of these. A peer sends its layout at registration,
so every field is checked here against the bounds below, raising only ValueError: a peer's
descriptor cannot make us compute or allocate without end. `check_int` and `check_ints` are
the same checks for the layout's own fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Bounds on a buffer, so that a peer's cannot make us compute or allocate without end.
MAX_LAYERS = 1024
MAX_NDIM = 4
MAX_DIM = 1 << 20
MAX_NAME = 64
MAX_TOKENS_PER_ROW = 1 << 12

# The dtypes a buffer may have: plain numeric types that a byte slice can be viewed as.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def check_int(what: str, v: object, lo: int, hi: int) -> int:
    """`v` as an int in [lo, hi], or ValueError (bools are not ints here)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        shown = v if v.bit_length() <= 64 else f"a {v.bit_length()}-bit int"  # not 4,000 digits
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {shown}")
    return v


def check_ints(what: str, v: object, max_len: int, lo: int, hi: int) -> tuple[int, ...]:
    if not isinstance(v, tuple):
        raise ValueError(f"{what} must be a tuple of ints, got {type(v).__name__}")
    if not 1 <= len(v) <= max_len:
        raise ValueError(f"{what} must have 1 to {max_len} entries, got {len(v)}")
    return tuple(check_int(f"{what}[{i}]", x, lo, hi) for i, x in enumerate(v))


@dataclass(frozen=True)
class BufferSpec:
    """One named KV buffer: `shape` per row, of `dtype`, in `layers` (None: every layer). A row
    holds one token, or one entry per `tokens_per_row` tokens (DeepSeek-V4's compressed KV,
    kvcache/v4_layout.py): a page of page_size tokens then has page_size / tokens_per_row rows."""

    name: str
    shape: tuple[int, ...]  # per row, e.g. (num_kv_heads, head_dim)
    dtype: str  # a name in DTYPES, e.g. "bfloat16"
    layers: tuple[int, ...] | None = None  # strictly increasing layer indices
    tokens_per_row: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 1 <= len(self.name) <= MAX_NAME:
            raise ValueError(f"buffer name must be a string of 1 to {MAX_NAME} characters")
        if not (self.name.isascii() and self.name.replace("_", "").replace(".", "").isalnum()):
            raise ValueError(f"buffer name {self.name!r}: use letters, digits, '_' and '.'")
        what = f"buffer {self.name!r}"
        check_ints(f"{what} shape", self.shape, MAX_NDIM, 1, MAX_DIM)
        if not isinstance(self.dtype, str):
            raise ValueError(f"{what} dtype must be a string, got {type(self.dtype).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{what} dtype {self.dtype[:32]!r} is not one of {sorted(DTYPES)}")
        check_int(f"{what} tokens_per_row", self.tokens_per_row, 1, MAX_TOKENS_PER_ROW)
        if self.layers is not None:
            layers = check_ints(f"{what} layers", self.layers, MAX_LAYERS, 0, MAX_LAYERS - 1)
            if any(a >= b for a, b in zip(layers, layers[1:], strict=False)):
                raise ValueError(f"{what} layers must be strictly increasing, got {layers}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes one row of this buffer occupies in one layer (one token's, at one token a
        row)."""
        return math.prod(self.shape) * self.itemsize

    def rows_per_page(self, page_size: int) -> int:
        """Rows a page of `page_size` tokens holds; ValueError unless a row's tokens divide it."""
        if page_size % self.tokens_per_row:
            raise ValueError(
                f"buffer {self.name!r}: a page of {page_size} tokens is not a whole number "
                f"of rows of {self.tokens_per_row} tokens"
            )
        return page_size // self.tokens_per_row


@dataclass(frozen=True)
class StateSpec:
    """One per-request state component: `shape` per request slot, of `dtype`, in `layers`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        # The same checks as a paged buffer's (a peer sends these too).
        BufferSpec(self.name, self.shape, self.dtype, self.layers)

    @property
    def slot_bytes(self) -> int:
        """Bytes one request's slot of this component occupies in one layer."""
        return BufferSpec(self.name, self.shape, self.dtype, self.layers).token_bytes
