"""Blocking JSON over HTTP for the operator tools (chaos, doctor): one call, one timeout.

The tools are sequential scripts, so a plain urllib call is the right size; the harness
never needs more than one call in flight. A call never raises for HTTP or network trouble:
it returns a Reply that says what happened, because for these tools a refused connection
or a 503 is an observation to record, not an exception to unwind.

Workers' /debug/* and /info need the cluster key. A tool decides its key once: `use_key`
(chaos with the key of the cluster it launched, doctor with --cluster-key-file), `use_bearer`
(an API key), or `use_key_for(url)` for a tool pointed at a cluster: the key named by
$PDSERVE_CLUSTER_KEY_FILE, else the one `pdserve launch` left for this user at that router's
address (runtime/local_keys.py). Undecided, the first call uses $PDSERVE_CLUSTER_KEY_FILE's.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, NamedTuple

from pdserve.runtime import local_keys
from pdserve.runtime.cluster_key import KEY_FILE_ENV, ClusterKey, ClusterKeyError

_auth: dict[str, str] | None = None  # the Authorization header; None: not decided yet
_origin = "no key"  # where the key came from, in words (for a tool to say when it is refused)


def use_key(key: ClusterKey | None, origin: str | None = None) -> None:
    """Send this cluster key's bearer token with every call from now on (None: no key);
    `origin` says where it came from."""
    global _auth, _origin
    _auth = key.http_headers if key is not None else {}
    _origin = origin or ("a cluster key" if key is not None else "no key")


def use_bearer(token: str, origin: str = "an API key") -> None:
    """Send `Authorization: Bearer <token>` (an API key) with every call from now on."""
    global _auth, _origin
    _auth = {"Authorization": f"Bearer {token}"}
    _origin = origin


def use_key_for(url: str) -> str | None:
    """Unless a key is decided already: the key of $PDSERVE_CLUSTER_KEY_FILE, else the one
    `pdserve launch` left for this user for the router at `url`, else none. Returns why a
    local key file found there was refused (then no key is sent), else None. A file that
    $PDSERVE_CLUSTER_KEY_FILE names but that cannot be used raises ClusterKeyError."""
    if _auth is not None:
        return None
    named = os.environ.get(KEY_FILE_ENV)
    if named:
        use_key(ClusterKey.load(named), f"${KEY_FILE_ENV} ({named})")
        return None
    try:
        key = local_keys.find(url)
    except ClusterKeyError as e:
        use_key(None, "no key (the local key file was refused)")
        return str(e)
    if key is None:
        use_key(None, f"no key (none for {url} in {local_keys.key_dir()})")
    else:
        use_key(key, f"the key `pdserve launch` left in {local_keys.key_path(url)}")
    return None


def key_origin() -> str:
    """Where the key every call sends came from, in words ("no key" without one)."""
    return _origin


def auth_headers() -> dict[str, str]:
    """The Authorization header every call sends (empty without a key), for a tool that
    speaks HTTP on a raw socket."""
    if _auth is None:
        use_key(ClusterKey.from_env(None), f"${KEY_FILE_ENV}")
    assert _auth is not None  # set just above
    return dict(_auth)


def _headers() -> dict[str, str]:
    return {"Content-Type": "application/json", **auth_headers()}


class Reply(NamedTuple):
    status: int | None  # None: no HTTP answer at all (refused, timed out, reset)
    body: Any  # the parsed JSON, or the text when it is not JSON
    error: str | None  # why there was no answer, or None

    @property
    def ok(self) -> bool:
        return self.status == 200


def call(method: str, url: str, body: Any = None, timeout_s: float = 10.0) -> Reply:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=_headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except TimeoutError:
        return Reply(None, None, f"{method} {url}: no answer within {timeout_s:.1f}s")
    except urllib.error.URLError as e:
        why = "no answer" if isinstance(e.reason, TimeoutError) else str(e.reason)
        return Reply(None, None, f"{method} {url}: {why}")
    except (ConnectionError, OSError) as e:  # reset mid-answer, broken pipe
        return Reply(None, None, f"{method} {url}: {e!r}")
    text = raw.decode(errors="replace")
    try:
        return Reply(status, json.loads(text), None)
    except json.JSONDecodeError:
        return Reply(status, text, None)


def get(url: str, timeout_s: float = 10.0) -> Reply:
    return call("GET", url, None, timeout_s)


def post(url: str, body: Any, timeout_s: float = 10.0) -> Reply:
    return call("POST", url, body, timeout_s)
