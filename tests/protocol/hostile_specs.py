"""Constraints within MAX_CONSTRAINT_BYTES whose compile recurses once per rule or `$ref` link:
compiled on an ordinary thread's 8 MiB stack, llguidance overflows it (SIGSEGV)."""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Callable

from pdserve.protocol.constraint import MAX_CONSTRAINT_BYTES


def _names(n: int) -> list[str]:
    """n distinct rule names, shortest first (so the most rules fit)."""
    words = (
        "".join(t)
        for size in itertools.count(1)
        for t in itertools.product(string.ascii_lowercase, repeat=size)
    )
    return list(itertools.islice(words, n))


def lark_chain(rules: int) -> str:
    """`start: a`, `a: b`, `b: c`, ... each rule calling the next, the last a literal."""
    nm = _names(rules + 1)
    body = "".join(f"{nm[i]}:{nm[i + 1]}\n" for i in range(rules))
    return f'start:{nm[0]}\n{body}{nm[rules]}:"x"\n'


def ref_chain(links: int) -> str:
    """A JSON schema whose `$defs` each hold an object whose one property is the next (in
    json.dumps' spacing, as the front end writes a schema's spec)."""
    nm = _names(links + 1)
    defs: dict[str, object] = {
        nm[i]: {"type": "object", "properties": {"x": {"$ref": f"#/$defs/{nm[i + 1]}"}}}
        for i in range(links)
    }
    defs[nm[links]] = {"type": "string"}
    return json.dumps({"$ref": f"#/$defs/{nm[0]}", "$defs": defs})


def longest(build: Callable[[int], str], limit: int = MAX_CONSTRAINT_BYTES) -> str:
    """`build(n)` for the largest n whose text fits `limit` bytes."""
    lo, hi = 1, limit // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid).encode()) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)
