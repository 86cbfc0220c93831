"""`pdserve doctor --url URL`: say in plain words where a cluster is stuck and why.

A thin shell: it fetches the document (source.py: a router's /debug/cluster, one bounded
call in which the router asks every worker for its /debug/state, each bounded too; or,
for a single server, its own /debug/state and /info), hands it to the pure
`diagnosis.diagnose`, and prints the result. `--file` reads a saved document instead,
so a document captured during an incident can be read again later. `--flight DIR` reads the
flight recorders the ranks of a failed tensor-parallel group left (`serve --flight-dir`;
doctor/flight.py), alone or beside --url or --file: a worker whose ranks failed has stopped,
so a `serve --tp 2` read alone answers nothing; its URL that cannot be read is then a finding
(degraded) beside what the dumps say.

The key (/debug/* needs one): --api-key or --cluster-key-file, else $PDSERVE_API_KEY or
$PDSERVE_CLUSTER_KEY_FILE, else the one `pdserve launch` left for this user at --url's address
(runtime/local_keys.py), so a local cluster needs no flag; a local key file that others can
read, or that is not this user's, is refused and named.

Exit code: 0 healthy, 1 degraded, 2 wedged (see pdserve/doctor/diagnosis.py for exactly
which finding is which), 3 nothing could be read (no answer, a refused key, not a document,
and no flight dump either).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.doctor.diagnosis import Diagnosis, Severity, diagnose
from pdserve.doctor.flight import add_flights
from pdserve.doctor.source import Unreadable, fetch, load
from pdserve.parallel.flight_recorder import read_dir
from pdserve.runtime import httpcall
from pdserve.runtime.cluster_key import ClusterKey

UNREADABLE = 3
UNKNOWN = "VERDICT: unknown: no cluster document, so nothing can be said about it"


def add_doctor_command(sub: Any) -> None:
    """Register `doctor` on the subparsers object of `pdserve`'s top-level parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "doctor",
        help="read a cluster's debug state and say where it is stuck and why",
        description="Read the debug state of a router and its workers (or of one `pdserve "
        "serve` process) and say in plain words whether it is healthy, and if not, which "
        "worker, thread, request or room is stuck and why.\n\n"
        "exit status: 0 healthy; 1 degraded (it serves, but something is wrong); 2 wedged "
        "(something cannot make progress); 3 nothing could be read.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--url",
        help="a router or a single server (serve), e.g. http://127.0.0.1:8000 (default: none; "
        "doctor reads --url, --file or --flight, or --flight with one of the others)",
    )
    src.add_argument(
        "--file",
        help="a document saved by --save (or a router's /debug/cluster) (default: none)",
    )
    p.add_argument(
        "--flight",
        default=None,
        metavar="DIR",
        help="tensor-parallel flight recorders (serve's --flight-dir, launch's LOG_DIR/flight): "
        "name the step and rank where a failed group's ranks parted (default: none)",
    )
    p.add_argument("--timeout", type=float, default=15.0, help="seconds for each HTTP call")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument(
        "--save", default=None, help="also write the fetched document here (default: not kept)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the router's or server's API key, if it has one (default: $PDSERVE_API_KEY)",
    )
    p.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="FILE",
        help="the cluster's key (default: $PDSERVE_CLUSTER_KEY_FILE, else the key `pdserve "
        "launch` left for you for the router at --url)",
    )
    p.set_defaults(func=cmd_doctor, usage_error=p.error)


def choose_key(args: argparse.Namespace) -> str | None:
    """Decide the key every call sends: flags, then the environment, then the local key of
    the cluster at --url (runtime/local_keys.py). Why a local key file was refused, if so."""
    api_key = args.api_key
    if api_key is None and args.cluster_key_file is None:
        api_key = os.environ.get("PDSERVE_API_KEY")
    if api_key:
        httpcall.use_bearer(api_key, "--api-key" if args.api_key else "$PDSERVE_API_KEY")
    elif args.cluster_key_file:
        key = ClusterKey.load(args.cluster_key_file)
        httpcall.use_key(key, f"--cluster-key-file {args.cluster_key_file}")
    elif args.url:
        return httpcall.use_key_for(args.url)
    return None


def cmd_doctor(args: argparse.Namespace) -> int:
    if not (args.url or args.file or args.flight):
        args.usage_error("give --url, --file or --flight (or --flight with one of the others)")
    flight = Path(args.flight) if args.flight else None
    if flight is not None and not flight.is_dir():
        return unreadable(args, f"cannot read flight recorders: {flight} is not a directory")
    failed: str | None = None  # why --url or --file could not be read, beside --flight
    if args.url or args.file:
        source = args.url or args.file
        try:
            result = diagnose(read_document(args), time.time())
        except Unreadable as e:
            if flight is None:
                return unreadable(args, f"cannot read the cluster from {source}: {e}")
            failed = f"cannot read the cluster from {source}: {e}"
            result = Diagnosis(header=f"flight recorders under {flight}")
            result.add(Severity.DEGRADED, source, f"cannot be read: {e}")
    else:  # the flight recorders alone: no cluster document
        source = str(flight)
        result = Diagnosis(header=f"flight recorders under {flight}")
    if flight is not None:
        groups = read_dir(flight)
        if failed is not None and not any(g.dumps for g in groups):
            return unreadable(args, f"{failed}; and no flight recorder under {flight}")
        add_flights(result, flight, groups)
    if args.json:
        doc = result.to_json()
        print(json.dumps(doc if failed is None else {**doc, "error": failed}, indent=1))
    else:
        print(f"pdserve doctor: {source}" + (f" and {flight}" if failed is not None else ""))
        print("\n".join(result.lines()))
    return result.code


def read_document(args: argparse.Namespace) -> dict[str, Any]:
    """The document at --url (with the key `choose_key` picks) or in --file (--save'd if
    asked); Unreadable, its message naming the key sent if it was refused."""
    refused = choose_key(args)
    if refused:
        print(f"pdserve doctor: {refused}", file=sys.stderr)
    try:
        doc = fetch(args.url, args.timeout) if args.url else load(args.file)
    except Unreadable as e:
        if not e.refused_key:
            raise
        origin = f"key sent: {httpcall.key_origin()}" + (f"; {refused}" if refused else "")
        raise Unreadable(f"{e} ({origin})", refused_key=True) from e
    if args.save:
        Path(args.save).write_text(json.dumps(doc, indent=1))
    return doc


def unreadable(args: argparse.Namespace, why: str) -> int:
    if args.json:
        print(json.dumps({"code": UNREADABLE, "verdict": UNKNOWN, "error": why}, indent=1))
    else:
        print(f"pdserve doctor: {why}\n{UNKNOWN}")
    return UNREADABLE
