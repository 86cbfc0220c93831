"""Where doctor's document comes from: a router's /debug/cluster, or one server read alone.

`pdserve doctor --url URL` works on a router and on a single `pdserve serve` process (a
co-located server, or one prefill or decode worker read directly). A router answers
/debug/cluster; a server answers 404 there, so doctor reads its /debug/state and /info and
wraps them as a server document:

    {"server": {"url": URL, "info": <its /info>}, "state": <its /debug/state>}

`diagnosis.diagnose` reads both shapes, and --save / --file keep whichever was fetched.
Anything else raises `Unreadable`: doctor says why and exits 3; it never calls a document
it could not understand healthy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.runtime import httpcall

KEY_HINT = (
    "pass --api-key, or set $PDSERVE_CLUSTER_KEY_FILE to the cluster's key file "
    "(or --cluster-key-file; a cluster `pdserve launch` started for you needs neither)"
)


class Unreadable(Exception):
    """No document doctor can read: the reason, in words. `refused_key`: the server refused
    the key sent (HTTP 401)."""

    def __init__(self, why: str, refused_key: bool = False) -> None:
        super().__init__(why)
        self.refused_key = refused_key


def fetch(url: str, timeout_s: float) -> dict[str, Any]:
    """A router's /debug/cluster, or a server document if `url` is a server; each HTTP call
    is bounded by `timeout_s`."""
    base = url.rstrip("/")
    r = httpcall.get(base + "/debug/cluster", timeout_s)
    if r.status == 404:  # not a router
        return _fetch_server(base, timeout_s)
    return check(_body(r, "/debug/cluster"))


def _fetch_server(base: str, timeout_s: float) -> dict[str, Any]:
    state = _body(httpcall.get(base + "/debug/state", timeout_s), "/debug/state")
    info = _body(httpcall.get(base + "/info", timeout_s), "/info")
    return check({"server": {"url": base, "info": info}, "state": state})


def _body(r: httpcall.Reply, path: str) -> Any:
    if r.status is None:
        raise Unreadable(r.error or f"{path}: no answer")
    if r.status == 401:
        raise Unreadable(f"{path}: HTTP 401, a key is needed: {KEY_HINT}", refused_key=True)
    if not r.ok:
        raise Unreadable(f"{path}: HTTP {r.status}: {str(r.body)[:300]}")
    return r.body


def load(path: str) -> dict[str, Any]:
    """A document saved by --save (or by hand from /debug/cluster)."""
    try:
        return check(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise Unreadable(str(e)) from e


def check(doc: Any) -> dict[str, Any]:
    """`doc` if it has one of the two shapes doctor reads; else Unreadable."""
    if isinstance(doc, dict):
        if isinstance(doc.get("router"), dict) and isinstance(doc.get("workers", {}), dict):
            return doc
        server = doc.get("server")
        if isinstance(server, dict) and "url" in server and isinstance(doc.get("state"), dict):
            return doc
    raise Unreadable(
        f"neither a router's /debug/cluster document nor a server's ({str(doc)[:200]})"
    )
