"""No `asyncio.wait_for` in pdserve (LESSONS #17, docs/architecture.md §Failure classes 17).

On Python 3.11 `asyncio.wait_for` can swallow a cancel that lands as its awaitable completes:
aiohttp's cancel of a handler whose client reset was lost that way inside the body read, and
the request ran on with no client. `asyncio.timeout` keeps the cancel."""

from __future__ import annotations

import re
from pathlib import Path

import pdserve

WAIT_FOR = re.compile(r"\bwait_for\(")


def test_pdserve_never_calls_asyncio_wait_for():
    root = Path(pdserve.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if WAIT_FOR.search(line) and "asyncio" in line
    ]
    assert found == [], f"use asyncio.timeout instead: {found}"
