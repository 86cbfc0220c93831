"""Hand-written /debug/cluster documents for doctor's analysis, in the router's shape."""

from __future__ import annotations

from typing import Any

P_URL, D_URL, D2_URL = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"
P_CONTROL = "tcp://127.0.0.1:2001"
D_IDENTITY, D2_IDENTITY = "decode-12-aaaaaa", "decode-13-bbbbbb"


def thread(name: str, age: float = 0.01, timeout: float = 5.0, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "alive": True,
        "heartbeat_age_s": age,
        "heartbeat_timeout_s": timeout,
        "crashes": 0,
        "last_error": None,
        "dead_reason": None,
        **kw,
    }


def request(
    rid: str, state: str = "running", in_state: float = 0.2, left: float = 50.0, pages: int = 2
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "state": state,
        "time_in_state_s": in_state,
        "deadline_in_s": left,
        "age_s": in_state,
        "pages": pages,
    }


def d_room(
    room: int,
    rid: str,
    state: str = "pending",
    in_state: float = 0.2,
    left: float = 50.0,
    pages: int = 2,
    peer: str = P_CONTROL,
) -> dict[str, Any]:
    return {
        "room": room,
        "epoch": 1,
        "peer": peer,
        "state": state,
        "request_id": rid,
        "pages": pages,
        "time_in_state_s": in_state,
        "deadline_in_s": left,
    }


def state(
    role: str,
    threads: list[dict[str, Any]] | None = None,
    requests: list[dict[str, Any]] | None = None,
    rooms: list[dict[str, Any]] | None = None,
    pages_used: int | None = None,
    peers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    requests, rooms = requests or [], rooms or []
    used = pages_used
    if used is None:
        used = sum(r["pages"] for r in requests) + sum(r.get("pages", 0) for r in rooms)
    threads = threads if threads is not None else [thread("engine", timeout=30), thread("control")]
    problems = [
        f"thread {t['name']} heartbeat stale"
        for t in threads
        if t["heartbeat_age_s"] > t["heartbeat_timeout_s"]
    ]
    return {
        "role": role,
        "threads": threads,
        "problems": problems,
        "engine": {
            "role": {"peers": peers or [], "rooms": rooms, "admitting": 0, "stats": {}},
            "requests": requests,
            "pool": {"pages_total": 100, "pages_free": 100 - used, "pages_used": used},
        },
    }


def row(url: str, role: str, pid: int, **kw: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"role": role, "pid": pid}
    if url == P_URL:
        info["control"] = P_CONTROL
    if url == D_URL:
        info["identity"] = D_IDENTITY
    if url == D2_URL:
        info["identity"] = D2_IDENTITY
    return {
        "url": url,
        "role": role,
        "pid": pid,
        "healthy": True,
        "in_rotation": True,
        "outstanding": 0,
        "last_error": None,
        "info": info,
        **kw,
    }


def entry(role: str, s: dict[str, Any] | None) -> dict[str, Any]:
    """A worker's entry: its state (default: healthy and idle) or {"error": ...}."""
    if s is None:
        return {"role": role, "state": state(role)}
    if "error" in s:
        return {"role": role, "error": s["error"]}
    return {"role": role, "state": s}


def cluster(
    p: dict[str, Any] | None = None,
    d: dict[str, Any] | None = None,
    rows: list[dict[str, Any]] | None = None,
    pairs: list[dict[str, Any]] | None = None,
    extra: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """1P + 1D by default, both healthy and idle; pass a worker's state (or error) to change."""
    rows = rows or [row(P_URL, "prefill", 11), row(D_URL, "decode", 12)]
    if pairs is None:
        pairs = [{"prefill": P_URL, "decode": D_URL, "ok": True, "usable": True, "error": None}]
    return {
        "router": {
            "pid": 10,
            "uptime_s": 30.0,
            "live_requests": 0,
            "problems": [],
            "workers": rows,
            "pairs": pairs,
        },
        "workers": {P_URL: entry("prefill", p), D_URL: entry("decode", d), **(extra or {})},
    }
