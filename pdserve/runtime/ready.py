"""The READY line: how a pdserve process tells whoever started it that it serves, and where.

Written with one write() call: print() issues the text and the newline separately, and a log
line from another thread landing in between once turned a worker's URL into garbage.
"""

from __future__ import annotations

import sys
from typing import TextIO


def announce_ready(url: str, out: TextIO | None = None) -> None:
    stream = out if out is not None else sys.stdout
    stream.write(f"READY {url}\n")
    stream.flush()
