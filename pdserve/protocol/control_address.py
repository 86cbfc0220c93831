"""A prefill worker's control address as decode workers and the router exchange it:
tcp://HOST:PORT, HOST a host name, an IPv4 address or a bracketed IPv6 address.

The one rule for every place that takes such an address from a peer: a worker's /generate
(`prefill`) and the router's reading of a prefill worker's /info (`control`).
"""

from __future__ import annotations

import ipaddress
import re

MAX_ADDRESS_CHARS = 270  # "tcp://" + a 253-character host name + ":65535"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ADDRESS = re.compile(
    rf"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|{_LABEL}(?:\.{_LABEL})*):(?P<port>[0-9]{{1,5}})"
)


def is_control_address(v: object) -> bool:
    """Whether `v` is a control address (port 1 to 65535); never raises."""
    m = _ADDRESS.fullmatch(v) if isinstance(v, str) and len(v) <= MAX_ADDRESS_CHARS else None
    if m is None or not 1 <= int(m["port"]) <= 65535:
        return False
    if m["host"].startswith("["):
        try:
            ipaddress.IPv6Address(m["host"][1:-1])
        except ValueError:
            return False
    return True
