"""Named fault points: deterministic, seeded failure injection, off and costless by default.

Two ways to set them. At process start, from the environment:
    PDSERVE_FAULTS="p.write=delay:2.0,control.recv.AbortAck=drop@0.5" PDSERVE_FAULT_SEED=7
At run time, on a server started with `--debug-faults`: POST /debug/faults with
{"spec": "...", "seed": 7} replaces every point (an empty spec clears them); GET shows them.

A spec is `point=action[:arg][@probability][#times]` (`#times`: fire at most that often, e.g.
`thread.engine=kill:1#1` kills the engine thread once). Actions done at the point itself:
    delay:SECONDS  stall the thread there
    raise          raise FaultInjected
    kill[:1|0]     raise ThreadKilled; at `thread.<name>` the supervisor restarts the thread
                   (kill, kill:1: a crash like any other) or declares it dead for good (kill:0)
    exit           os._exit(70): the process dies at once, no cleanup
Actions on a message, only at `control.recv.<Type>` / `control.send.<Type>` and
`tp.recv.<rank>`, returned by `hit()` as a Verdict for the caller to carry out
(transfer/control.py; a tensor-parallel follower, engine/tp_follower.py, acts on `malformed`
only: the step record it read is changed before it is digested, and passes the others):
    drop           the message is lost
    duplicate      it is delivered / sent twice
    reorder        it is held back until the next message in the same direction has passed
                   (at most HOLD_S in transfer/control.py)
    unknown        an unknown-type frame goes in its place
    malformed      garbage bytes go in its place
Points in the code: `thread.<name>` (before each tick of a supervised thread), `p.write`
(before a prefill worker writes KV pages), `d.start_decode` (after PrefillDone, before the
request joins the decode batch), `control.recv.<Type>` and `control.send.<Type>`, `tp.recv.<rank>`
(a tensor-parallel follower, on each forward record it receives).

Each point draws from its own generator seeded by (seed, point), so whether the n-th hit of
a point fires depends only on the seed, whatever other threads hit meanwhile. `hit()` with no
point set is one attribute check; a configuration is swapped whole, under a lock.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

log = logging.getLogger(__name__)

EXIT_CODE = 70  # the `exit` action's status (EX_SOFTWARE)
MESSAGE_POINTS = ("control.recv.", "control.send.", "tp.recv.")


class FaultInjected(RuntimeError):
    """Raised at a fault point whose action is `raise`."""


class ThreadKilled(FaultInjected):
    """Raised at a fault point whose action is `kill`; the supervisor reads `restart`."""

    def __init__(self, point: str, restart: bool) -> None:
        then = "restarted" if restart else "not restarted"
        super().__init__(f"thread killed at fault point {point} ({then})")
        self.point = point
        self.restart = restart


class Action(Enum):
    DELAY = "delay"
    RAISE = "raise"
    KILL = "kill"
    EXIT = "exit"
    DROP = "drop"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    UNKNOWN = "unknown"
    MALFORMED = "malformed"


class Verdict(Enum):
    """What the caller of `hit()` does with the message at that point."""

    PASS = "pass"
    DROP = "drop"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    UNKNOWN = "unknown"
    MALFORMED = "malformed"


_VERDICTS = {Action(v.value): v for v in Verdict if v is not Verdict.PASS}


@dataclass(frozen=True)
class Fault:
    action: Action
    arg: float | None = None  # delay: seconds; kill: 1 (restart) or 0 (dead for good)
    probability: float = 1.0
    times: int | None = None  # fire at most this often; None: whenever drawn

    def __str__(self) -> str:
        arg = "" if self.arg is None else f":{self.arg:g}"
        times = "" if self.times is None else f"#{self.times}"
        return f"{self.action.value}{arg}@{self.probability:g}{times}"


def parse(spec: str) -> dict[str, Fault]:
    """`point=action[:arg][@probability][#times],...` -> {point: Fault}; ValueError says why."""
    faults: dict[str, Fault] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            point, fault = _parse_one(item)
        except ValueError as e:
            raise ValueError(f"fault spec {item!r}: {e}") from None
        faults[point] = fault
    return faults


def _parse_one(item: str) -> tuple[str, Fault]:
    point, sep, rest = item.partition("=")
    if not sep or not point:
        raise ValueError("expected point=action[:arg][@probability][#times]")
    rest, hash_, times_text = rest.partition("#")
    times = None
    if hash_:
        if not times_text.isdigit() or int(times_text) < 1:
            raise ValueError(f"#times must be a whole number >= 1, got {times_text!r}")
        times = int(times_text)
    rest, at, prob_text = rest.partition("@")
    name, colon, arg_text = rest.partition(":")
    try:
        action = Action(name)
    except ValueError:
        raise ValueError(f"action must be one of {', '.join(a.value for a in Action)}") from None
    arg = _number(arg_text, "arg") if colon else None
    probability = _number(prob_text, "probability") if at else 1.0
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"probability must be in (0, 1], got {probability:g}")
    if action is Action.DELAY and (arg is None or arg < 0):
        raise ValueError("delay needs SECONDS >= 0 (delay:SECONDS)")
    if action is Action.KILL and arg not in (None, 0.0, 1.0):
        raise ValueError("kill takes 1 (restart the thread) or 0 (dead for good)")
    if action not in (Action.DELAY, Action.KILL) and arg is not None:
        raise ValueError(f"{action.value} takes no argument")
    if action in _VERDICTS and not point.startswith(MESSAGE_POINTS):
        raise ValueError(
            f"{action.value} acts on a message: only at control.recv/send points or tp.recv"
        )
    return point, Fault(action, arg, probability, times)


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None


@dataclass(frozen=True)
class _Plan:
    """One configuration: never changed once built, replaced whole by `configure`."""

    points: dict[str, Fault]
    seed: int
    rngs: dict[str, random.Random]
    fired: Counter[str] = field(default_factory=Counter)

    @classmethod
    def build(cls, spec: str, seed: int) -> _Plan:
        points = parse(spec)
        return cls(points, seed, {p: _draws(seed, p) for p in points})


def _draws(seed: int, point: str) -> random.Random:
    """The generator of `point`'s draws under `seed`: one per point (module docstring)."""
    return random.Random(f"{seed}:{point}")


def first_firing(point: str, probability: float, seed: int, limit: int) -> int | None:
    """The hit (1, 2, ...) on which `point=ACTION@probability` first fires under `seed`, if it
    does within `limit` hits: how a harness places a fault it cannot set at run time (a
    tensor-parallel follower's, chaos/tp.py)."""
    draws = _draws(seed, point)
    return next((n for n in range(1, limit + 1) if draws.random() < probability), None)


class Faults:
    def __init__(self, spec: str = "", seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._plan = _Plan.build(spec, seed)

    @property
    def enabled(self) -> bool:
        return bool(self._plan.points)

    def configure(self, spec: str, seed: int) -> None:
        """Replace every point (an empty spec clears them); ValueError leaves them as they were."""
        plan = _Plan.build(spec, seed)
        with self._lock:
            self._plan = plan
        log.warning("fault points set: %s (seed %d)", spec or "none", seed)

    def snapshot(self) -> dict[str, object]:
        plan = self._plan
        with self._lock:
            fired = dict(plan.fired)
        return {
            "points": {p: str(f) for p, f in plan.points.items()},
            "seed": plan.seed,
            "fired": fired,
        }

    def hit(self, point: str) -> Verdict:
        """Apply the fault at `point`: delay, raise, kill and exit happen here; the rest is
        returned for the caller to do to its message (PASS: carry on as if nothing happened)."""
        plan = self._plan
        if not plan.points:
            return Verdict.PASS
        fault = plan.points.get(point)
        if fault is None:
            return Verdict.PASS
        with self._lock:
            if fault.times is not None and plan.fired[point] >= fault.times:
                return Verdict.PASS
            if plan.rngs[point].random() >= fault.probability:
                return Verdict.PASS
            plan.fired[point] += 1
        log.warning("fault point %s fired: %s", point, fault)
        match fault.action:
            case Action.DELAY:
                time.sleep(fault.arg or 0.0)
                return Verdict.PASS
            case Action.RAISE:
                raise FaultInjected(f"fault injected at {point}")
            case Action.KILL:
                raise ThreadKilled(point, restart=fault.arg != 0.0)
            case Action.EXIT:
                log.critical("fault point %s: exiting with code %d, no cleanup", point, EXIT_CODE)
                os._exit(EXIT_CODE)
            case _:
                return _VERDICTS[fault.action]


FAULTS = Faults(
    os.environ.get("PDSERVE_FAULTS", ""), int(os.environ.get("PDSERVE_FAULT_SEED", "0") or 0)
)
