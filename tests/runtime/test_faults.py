"""Fault points: the spec grammar, seeded determinism, run-time configure/snapshot, and that
a process with no fault point set pays (almost) nothing for them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.runtime.faults import (
    EXIT_CODE,
    Action,
    Fault,
    FaultInjected,
    Faults,
    ThreadKilled,
    Verdict,
    first_firing,
    parse,
)

RECV = "control.recv.Ping"


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("p.write=delay:1.5", Fault(Action.DELAY, 1.5)),
        ("p.write=delay:0@0.5", Fault(Action.DELAY, 0.0, 0.5)),
        ("thread.engine=raise", Fault(Action.RAISE)),
        ("thread.engine=kill", Fault(Action.KILL)),
        ("thread.engine=kill:0", Fault(Action.KILL, 0.0)),
        ("thread.engine=kill:1@0.1", Fault(Action.KILL, 1.0, 0.1)),
        ("d.start_decode=exit", Fault(Action.EXIT)),
        (f"{RECV}=drop@0.25", Fault(Action.DROP, None, 0.25)),
        ("control.send.Abort=duplicate", Fault(Action.DUPLICATE)),
        (f"{RECV}=reorder", Fault(Action.REORDER)),
        ("control.send.Pong=unknown", Fault(Action.UNKNOWN)),
        (f"{RECV}=malformed@1", Fault(Action.MALFORMED)),
        ("thread.engine=kill:1#1", Fault(Action.KILL, 1.0, 1.0, 1)),
        (f"{RECV}=drop@0.5#3", Fault(Action.DROP, None, 0.5, 3)),
    ],
)
def test_every_action_parses_and_renders_back(spec, fault):
    point = spec.partition("=")[0]
    assert parse(spec) == {point: fault}
    assert parse(f"{point}={fault}") == {point: fault}  # the snapshot's form parses back


def test_a_spec_of_several_points_and_spaces():
    f = parse(" p.write=delay:2 , control.recv.Abort=drop@0.5,,thread.x=kill:0 ")
    assert list(f) == ["p.write", "control.recv.Abort", "thread.x"]
    assert parse("") == {} and parse(" , ") == {}


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("nonsense", "expected point=action"),
        ("=drop", "expected point=action"),
        ("p.write=explode", "action must be one of"),
        ("p.write=delay", "delay needs SECONDS"),
        ("p.write=delay:-1", "delay needs SECONDS"),
        ("p.write=delay:soon", "arg 'soon' is not a number"),
        ("thread.x=kill:2", "kill takes 1"),
        ("thread.x=raise:3", "raise takes no argument"),
        (f"{RECV}=drop@0", "probability must be in"),
        (f"{RECV}=drop@1.5", "probability must be in"),
        (f"{RECV}=drop@often", "probability 'often' is not a number"),
        ("p.write=duplicate", "only at control.recv/send points"),
        ("thread.x=drop", "only at control.recv/send points"),
        ("thread.x=kill#0", "#times must be a whole number"),
        ("thread.x=kill#once", "#times must be a whole number"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, why):
    with pytest.raises(ValueError, match=why) as e:
        parse(f"p.write=delay:1,{spec}")
    assert repr(spec) in str(e.value)  # names the item at fault


def test_times_caps_how_often_a_point_fires():
    f = Faults(f"{RECV}=drop#2", seed=1)
    assert [f.hit(RECV) for _ in range(4)] == [
        Verdict.DROP,
        Verdict.DROP,
        Verdict.PASS,
        Verdict.PASS,
    ]
    assert f.snapshot()["fired"] == {RECV: 2}


@pytest.mark.parametrize("action", ["drop", "duplicate", "reorder", "unknown", "malformed"])
def test_message_actions_come_back_as_verdicts(action):
    f = Faults(f"{RECV}={action}")
    assert f.hit(RECV) is Verdict(action)
    assert f.hit("control.recv.Pong") is Verdict.PASS  # another point


def test_raise_kill_and_delay_happen_at_the_point():
    with pytest.raises(FaultInjected, match="at p.write") as e:
        Faults("p.write=raise").hit("p.write")
    assert not isinstance(e.value, ThreadKilled)
    for spec, restart in (("kill", True), ("kill:1", True), ("kill:0", False)):
        with pytest.raises(ThreadKilled) as k:
            Faults(f"thread.x={spec}").hit("thread.x")
        assert k.value.restart is restart and k.value.point == "thread.x"
    t0 = time.monotonic()
    assert Faults("p.write=delay:0.1").hit("p.write") is Verdict.PASS
    assert time.monotonic() - t0 >= 0.1


@pytest.mark.process
def test_exit_ends_the_process_at_once_with_code_70():
    code = (
        "from pdserve.runtime.faults import Faults\n"
        "import atexit; atexit.register(print, 'cleanup ran')\n"
        "Faults('p.write=exit').hit('p.write')\n"
        "print('still alive')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert r.returncode == EXIT_CODE == 70
    assert r.stdout == ""  # neither the next line nor atexit ran


def fires(f: Faults, point: str, n: int) -> list[bool]:
    return [f.hit(point) is not Verdict.PASS for _ in range(n)]


def test_the_seed_decides_which_hits_fire_per_point():
    spec = f"{RECV}=drop@0.5,control.send.Pong=drop@0.5"
    a = fires(Faults(spec, seed=7), RECV, 200)
    b = Faults(spec, seed=7)
    fires(b, "control.send.Pong", 50)  # hits of another point do not shift this one
    assert fires(b, RECV, 200) == a
    assert 60 < sum(a) < 140
    assert fires(Faults(spec, seed=8), RECV, 200) != a
    c = Faults()
    c.configure(spec, 7)
    assert fires(c, RECV, 200) == a  # configure restarts the sequence from the seed


@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_first_firing_says_which_hit_a_seed_fires_on(seed):
    """What a harness places a fault by (chaos tp-desync): the hit `hit()` fires on."""
    faults = Faults("tp.recv.1=malformed@0.05#1", seed)
    fired = next(n for n in range(1, 1000) if faults.hit("tp.recv.1") is Verdict.MALFORMED)
    assert first_firing("tp.recv.1", 0.05, seed, 1000) == fired
    assert first_firing("tp.recv.1", 0.05, seed, fired - 1) is None


def test_configure_replaces_and_snapshot_shows_points_seed_and_fired():
    f = Faults()
    assert f.snapshot() == {"points": {}, "seed": 0, "fired": {}} and not f.enabled
    f.configure(f"{RECV}=drop@0.5,p.write=delay:0,thread.x=kill:0", 3)
    hits = fires(f, RECV, 20)
    snap = f.snapshot()
    assert snap["points"] == {RECV: "drop@0.5", "p.write": "delay:0@1", "thread.x": "kill:0@1"}
    assert snap["seed"] == 3 and snap["fired"] == {RECV: sum(hits)}
    with pytest.raises(ValueError):
        f.configure("p.write=explode", 4)
    assert f.snapshot() == snap  # a bad spec leaves the points as they were
    f.configure("", 0)
    assert f.snapshot() == {"points": {}, "seed": 0, "fired": {}} and not f.enabled
    assert f.hit(RECV) is Verdict.PASS


def test_hit_with_no_point_set_costs_almost_nothing():
    off, on = Faults(), Faults("p.write=delay:0")
    # `hit` must return before taking the lock or drawing: make both impossible.
    off._lock = None  # type: ignore[assignment]
    assert off.hit(RECV) is Verdict.PASS
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        off.hit(RECV)
    per_hit = (time.perf_counter() - t0) / n
    assert per_hit < 2e-6, f"{per_hit * 1e9:.0f} ns per hit with no point set"
    assert on.hit(RECV) is Verdict.PASS  # set, but not this point: also no draw
    assert on.snapshot()["fired"] == {}
