"""Named fault points: deterministic, seeded failure injection, off and costless by default.

Enabled by PDSERVE_FAULTS at process start, e.g.
    PDSERVE_FAULTS="p.write=delay:2.0,control.recv.AbortAck=drop@0.5" PDSERVE_FAULT_SEED=7
A spec is `point=action[:arg][@probability]`; actions are `delay:SECONDS` (stall the thread
at that point), `raise` (raise FaultInjected there) and `drop` (the caller skips the message).
Points in the code: `p.write` (before a prefill worker writes KV pages), `d.start_decode`
(after PrefillDone, before the request joins the decode batch), `control.recv.<Type>` and
`control.send.<Type>` (a control message of that type, in or out).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger(__name__)


class FaultInjected(RuntimeError):
    """Raised at a fault point whose action is `raise`."""


@dataclass(frozen=True)
class Fault:
    action: str  # delay | raise | drop
    arg: float = 0.0
    probability: float = 1.0


def parse(spec: str) -> dict[str, Fault]:
    faults: dict[str, Fault] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, sep, rest = item.partition("=")
        if not sep:
            raise ValueError(f"fault spec {item!r}: expected point=action")
        rest, _, prob = rest.partition("@")
        action, _, arg = rest.partition(":")
        if action not in ("delay", "raise", "drop"):
            raise ValueError(f"fault spec {item!r}: action must be delay, raise or drop")
        faults[point] = Fault(action, float(arg or 0.0), float(prob or 1.0))
    return faults


class Faults:
    def __init__(self, spec: str = "", seed: int = 0) -> None:
        self.points = parse(spec)
        self.rng = random.Random(seed)
        self.fired: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return bool(self.points)

    def hit(self, point: str) -> bool:
        """Apply the fault at `point`: stalls or raises here; True means 'drop this message'."""
        if not self.points:
            return False
        fault = self.points.get(point)
        if fault is None or self.rng.random() >= fault.probability:
            return False
        self.fired[point] += 1
        log.warning("fault point %s fired: %s", point, fault)
        if fault.action == "delay":
            time.sleep(fault.arg)
            return False
        if fault.action == "raise":
            raise FaultInjected(f"fault injected at {point}")
        return True


FAULTS = Faults(
    os.environ.get("PDSERVE_FAULTS", ""), int(os.environ.get("PDSERVE_FAULT_SEED", "0") or 0)
)
