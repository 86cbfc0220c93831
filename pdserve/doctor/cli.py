"""`pdserve doctor --url ROUTER`: say in plain words where a cluster is stuck and why.

A thin shell: it fetches the router's /debug/cluster (one bounded call; the router asks
every worker for its /debug/state, each bounded too), hands it to the pure
`diagnosis.diagnose`, and prints the result. `--file` reads a saved document instead,
so a document captured during an incident can be read again later.

Exit code: 0 healthy, 1 degraded, 2 wedged (see pdserve/doctor/diagnosis.py for exactly
which finding is which), 3 the document could not be read at all.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from pdserve.doctor.diagnosis import Diagnosis, diagnose
from pdserve.runtime import httpcall

UNREADABLE = 3


def add_doctor_command(sub: Any) -> None:
    """Register `doctor` on the subparsers object of `pdserve`'s top-level parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "doctor", help="read a cluster's debug state and say where it is stuck and why"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="the router, e.g. http://127.0.0.1:8000")
    src.add_argument("--file", help="a saved /debug/cluster document")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds for /debug/cluster")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--save", default=None, help="also write the fetched document here")
    p.add_argument(
        "--api-key",
        default=None,
        help="the router's API key, if it has one (default: $PDSERVE_API_KEY; the cluster key "
        "from $PDSERVE_CLUSTER_KEY_FILE works too)",
    )
    p.set_defaults(func=cmd_doctor)


def fetch(url: str, timeout_s: float) -> dict[str, Any]:
    """The router's /debug/cluster; ValueError saying why it could not be read."""
    r = httpcall.get(url.rstrip("/") + "/debug/cluster", timeout_s)
    if not r.ok or not isinstance(r.body, dict) or "router" not in r.body:
        raise ValueError(r.error or f"HTTP {r.status}: {str(r.body)[:300]}")
    return r.body


def cmd_doctor(args: argparse.Namespace) -> int:
    source = args.url or args.file
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    if api_key:
        httpcall.use_bearer(api_key)
    try:
        doc = fetch(args.url, args.timeout) if args.url else json.loads(Path(args.file).read_text())
    except (ValueError, OSError) as e:
        print(f"pdserve doctor: cannot read the cluster from {source}: {e}")
        print("VERDICT: unknown: no cluster document, so nothing can be said about it")
        return UNREADABLE
    if args.save:
        Path(args.save).write_text(json.dumps(doc, indent=1))
    result: Diagnosis = diagnose(doc, time.time())
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(f"pdserve doctor: {source}")
        print("\n".join(result.lines()))
    return result.code
