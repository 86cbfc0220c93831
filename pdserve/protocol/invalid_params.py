"""InvalidParams, the caller's-fault error every check of request input raises, and `show`,
how a caller's value appears in its message. One module below SamplingParams and the
constraint (protocol/sampling.py, protocol/constraint.py), which both raise it; sampling.py
re-exports both names, the ones the rest of pdserve imports.

Sans-I/O and torch-free.
"""

from __future__ import annotations

from typing import TypeGuard


class InvalidParams(ValueError):
    """Bad request parameters: the caller's fault, reported as HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def is_int(v: object) -> TypeGuard[int]:
    """An int and not a bool (JSON true is not 1 here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def show(v: object, limit: int = 60) -> str:
    """A caller's value for an error message: short, and never raising."""
    if is_int(v) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    try:
        text = repr(v)
    except ValueError:  # an int past sys.get_int_max_str_digits() inside a container
        return f"a {type(v).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
