"""A role changes its engine only by asking (engine/role.py effects), and the engine applies what
it asked in order, right after the verb that asked (engine/role_host.py).

The roles are read with `ast`: they may only read their `RoleHost`. The application is driven
by a stub role on a real engine (the tiny model, on the CPU)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

import pdserve
from pdserve.engine.offline import build_engine
from pdserve.engine.request import Event, Request, RequestOutput
from pdserve.engine.role import Adopt, ComputePrompt, Effect, Finish, KeepPages, Role
from pdserve.kvcache.lease import Lease, LeaseState
from pdserve.protocol.sampling import SamplingParams

ROOT = Path(pdserve.__file__).parent
# What a role may touch of its engine: reads, and two questions answered at once.
READS = {
    "clock",
    "pool",
    "pages",
    "eos_token_ids",
    "vocab_size",
    "last_tick",
    "request_timeout_s",
    "validate",
    "streams_early",
    "open_lease",
}
PROMPT = [(7 * i) % 200 + 3 for i in range(9)]
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def role_host_members() -> set[str]:
    tree = ast.parse((ROOT / "engine" / "role.py").read_text())
    host = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RoleHost")
    names = set()
    for node in host.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return names


def engine_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every `self.engine.<name>` and `engine.<name>` in `path`."""
    used = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "engine") or (
            isinstance(base, ast.Attribute)
            and base.attr == "engine"
            and isinstance(base.value, ast.Name)
            and base.value.id == "self"
        ):
            used.append((node.lineno, node.attr))
    return used


def test_role_host_is_only_reads():
    """A verb that changes the engine added to RoleHost must be an effect instead."""
    assert role_host_members() == READS


def test_roles_only_read_their_engine():
    roles = [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if "RoleHost" in p.read_text() and p.parent.name != "engine"
    ]
    assert {p.relative_to(ROOT).as_posix() for p in roles} >= {
        "worker/prefill/role.py",
        "worker/decode/role.py",
    }
    for path in roles:
        used = engine_uses(path)
        assert used, f"{path} reads nothing of its engine: the check would see nothing"
        wrong = [(line, name) for line, name in used if name not in READS]
        assert wrong == [], f"{path.relative_to(ROOT)} changes its engine directly: {wrong}"


class Asking(Role):
    """A role that asks, in each verb, what the test queued for that verb, then raises what the
    test queued for it, and notes in each what `watch()` (the test's) says of the engine then.
    Its `fail` notes the request and answers `fails` (or raises it)."""

    takes_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self.asks: dict[str, list[Effect]] = {}
        self.raises: dict[str, Exception] = {}
        self.watch: Callable[[], object] = lambda: None
        self.seen: list[tuple[str, object]] = []
        self.fails: bool | Exception = False
        self.failed: list[str] = []

    def _verb(self, verb: str, *args: object) -> None:
        self.seen.append((verb, (*args, self.watch())))
        self.effects.extend(self.asks.pop(verb, []))
        if verb in self.raises:
            raise self.raises.pop(verb)

    def fail(self, req: Request, why: str, now: float) -> bool:
        self.failed.append(req.request_id)
        if isinstance(self.fails, Exception):
            raise self.fails
        return self.fails

    def expire(self, now: float) -> None:
        self._verb("expire")

    def admit(self, now: float) -> None:
        self._verb("admit")

    def take_token(self, req: Request, tok: int, lp: object, now: float) -> bool:
        self._verb("take_token", req.request_id)
        return True

    def kept(self, req: Request, lease: Lease | None, now: float) -> None:
        self._verb("kept", req.request_id, lease)


@pytest.fixture
def engine(tiny_dir):
    eng = build_engine(tiny_dir, page_size=4, max_batched_tokens=32, prefix_cache=False)
    role = Asking()
    eng.attach(role, lambda msg: None)
    return eng, role


def request(eng, rid: str, outs: list[RequestOutput]) -> Request:
    return eng.make_request(rid, PROMPT, GREEDY, outs.append, None)


def prompt_tokens(eng) -> float:
    return eng.metrics.registry.get_sample_value("pdserve_prompt_tokens_total")


def test_effects_are_applied_in_order_right_after_the_verb(engine):
    eng, role = engine
    outs: list[RequestOutput] = []
    a = request(eng, "a", outs)
    role.asks["expire"] = [ComputePrompt(a)]
    role.asks["admit"] = [Finish(a, Event.ABORT)]
    role.watch = lambda: eng.scheduler.get("a") is a
    counted = prompt_tokens(eng)
    eng.tick()
    # expire's effect was applied before admit ran: admit saw `a` scheduled.
    assert role.seen == [("expire", (False,)), ("admit", (True,))]
    # In order: computed, then aborted; the other way round, `a` would stay scheduled.
    assert eng.scheduler.get("a") is None and not eng.has_work()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert prompt_tokens(eng) == counted + len(PROMPT)


def test_kept_pages_reach_the_role_before_the_next_effect(engine):
    eng, role = engine
    outs_a: list[RequestOutput] = []
    outs_b: list[RequestOutput] = []
    a, b = request(eng, "a", outs_a), request(eng, "b", outs_b)
    role.asks["admit"] = [ComputePrompt(a)]
    # a's first token is taken: a leaves the batch keeping its pages, then b ends.
    role.asks["take_token"] = [KeepPages(a, Event.STOP, "room 1"), Finish(b, Event.ABORT)]
    role.watch = lambda: b.status.finished
    for _ in range(20):
        if outs_a:
            break
        eng.tick()
    kept = [what for verb, what in role.seen if verb == "kept"]
    assert len(kept) == 1
    rid, lease, b_finished = kept[0]
    assert rid == "a" and not b_finished  # b's Finish came after a's pages reached the role
    assert isinstance(lease, Lease) and lease.owner == "room 1" and lease.state is LeaseState.LIVE
    assert len(lease.pages) == eng.pool.pages_needed(len(PROMPT))
    assert [o.finish_reason for o in outs_a] == ["stop"] and a.output_ids == []
    assert [o.finish_reason for o in outs_b] == ["abort"]
    assert eng.scheduler.get("a") is None and eng.leases.violations() == []
    lease.release()
    assert eng.pool.allocator.num_held == 0


def test_a_failing_adopt_fails_only_its_request(engine, monkeypatch):
    """The first Adopt raises: its lease goes back and its request fails; the next one, asked
    in the same verb, decodes as usual."""
    eng, role = engine
    role.takes_tokens = False
    outs: dict[str, list[RequestOutput]] = {"r0": [], "r1": []}
    reqs = {rid: request(eng, rid, outs[rid]) for rid in outs}
    need = eng.pool.pages_needed(len(PROMPT))
    leases = {rid: eng.open_lease(f"room {rid}", need).hand_over(rid) for rid in outs}
    real = eng.scheduler.adopt

    def adopt(req: Request, lease: Lease) -> None:
        if req.request_id == "r0":
            raise ValueError("no room for it")
        real(req, lease)

    monkeypatch.setattr(eng.scheduler, "adopt", adopt)
    role.asks["admit"] = [Adopt(reqs[rid], leases[rid], 5, None) for rid in outs]
    for _ in range(20):
        if all(o and o[-1].finish_reason for o in outs.values()):
            break
        eng.tick()
    assert outs["r0"][-1].finish_reason == "error"
    assert outs["r0"][-1].error == "its decode could not start: ValueError: no room for it"
    assert leases["r0"].state is LeaseState.RELEASED
    assert outs["r1"][-1].finish_reason == "length"
    assert [t for o in outs["r1"] for t in o.token_ids][0] == 5  # the peer's first token
    assert len(reqs["r1"].output_ids) == GREEDY.max_tokens
    assert eng.pool.allocator.num_held == 0 and eng.leases.violations() == []


def leased(eng, rid: str) -> Lease:
    """Pages for `rid`'s prompt, as a peer's room hands them to its request."""
    return eng.open_lease(f"room {rid}", eng.pool.pages_needed(len(PROMPT))).hand_over(rid)


def refuse(eng, monkeypatch, rid: str) -> None:
    """The scheduler refuses to adopt `rid`."""
    real = eng.scheduler.adopt

    def adopt(req: Request, lease: Lease) -> None:
        if req.request_id == rid:
            raise ValueError("no room for it")
        real(req, lease)

    monkeypatch.setattr(eng.scheduler, "adopt", adopt)


def test_what_a_verb_asked_before_it_raised_is_applied_before_the_next_command(engine):
    """`expire` asks an Adopt, then raises: the Adopt is applied in that tick all the same, so
    the abort the next tick handles finds the request (else it would find nothing to end, and
    the request would decode to its max_tokens)."""
    eng, role = engine
    role.takes_tokens = False
    outs: list[RequestOutput] = []
    a = request(eng, "a", outs)
    role.asks["expire"] = [Adopt(a, leased(eng, "a"), 5, None)]
    role.raises["expire"] = RuntimeError("a bug after asking")
    with pytest.raises(RuntimeError, match="a bug after asking"):
        eng.tick()
    assert eng.scheduler.get("a") is a and role.effects == []
    eng.abort("a")
    eng.tick()
    assert [o.finish_reason for o in outs] == [None, "abort"]
    assert a.output_ids == [5]  # the peer's token, and not one more
    assert eng.pool.allocator.num_held == 0 and eng.leases.violations() == []


def test_an_effect_whose_role_fail_raises_still_fails_alone(engine, monkeypatch):
    """r0's Adopt is refused and the role's `fail` raises as well: r0 still ends, plainly, its
    lease back; r1's Adopt, asked after it in the same verb, decodes as usual."""
    eng, role = engine
    role.takes_tokens = False
    role.fails = RuntimeError("the role's fail has a bug")
    outs: dict[str, list[RequestOutput]] = {"r0": [], "r1": []}
    reqs = {rid: request(eng, rid, outs[rid]) for rid in outs}
    leases = {rid: leased(eng, rid) for rid in outs}
    refuse(eng, monkeypatch, "r0")
    role.asks["admit"] = [Adopt(reqs[rid], leases[rid], 5, None) for rid in outs]
    for _ in range(20):
        if all(o and o[-1].finish_reason for o in outs.values()):
            break
        eng.tick()
    assert role.failed == ["r0"]
    assert outs["r0"][-1].finish_reason == "error"
    assert outs["r0"][-1].error == "its decode could not start: ValueError: no room for it"
    assert leases["r0"].state is LeaseState.RELEASED
    assert outs["r1"][-1].finish_reason == "length"
    assert len(reqs["r1"].output_ids) == GREEDY.max_tokens
    assert eng.pool.allocator.num_held == 0 and eng.leases.violations() == []


def test_effects_after_one_whose_failure_cannot_be_handled_are_kept(engine, monkeypatch):
    """r0's Adopt is refused and even its plain FAIL raises: the error goes on to the
    supervisor, and r1's Adopt, not applied yet, stays first in line; the next tick applies it
    before any command, so an abort for r1 finds it."""
    eng, role = engine
    role.takes_tokens = False
    outs: dict[str, list[RequestOutput]] = {"r0": [], "r1": []}
    reqs = {rid: request(eng, rid, outs[rid]) for rid in outs}
    leases = {rid: leased(eng, rid) for rid in outs}
    refuse(eng, monkeypatch, "r0")
    real_finish = eng.finish

    def finish(req: Request, event: Event, error: str | None = None, **kw: object) -> object:
        if req.request_id == "r0":
            raise RuntimeError("cannot end r0")
        return real_finish(req, event, error, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(eng, "finish", finish)
    later = Finish(reqs["r0"], Event.ABORT)  # asked after the Adopts: it stays after them
    role.asks["admit"] = [Adopt(reqs[rid], leases[rid], 5, None) for rid in outs] + [later]
    with pytest.raises(RuntimeError, match="cannot end r0"):
        eng.tick()
    assert role.effects == [Adopt(reqs["r1"], leases["r1"], 5, None), later]
    assert leases["r0"].state is LeaseState.RELEASED  # r0's Adopt let its lease go
    monkeypatch.setattr(eng, "finish", real_finish)
    eng.abort("r1")
    eng.tick()
    assert [o.finish_reason for o in outs["r1"]] == [None, "abort"]
    assert reqs["r1"].output_ids == [5]
    assert [o.finish_reason for o in outs["r0"]] == ["abort"]  # the Finish after, applied
    assert role.effects == [] and eng.scheduler.get("r1") is None
    assert eng.pool.allocator.num_held == 0 and eng.leases.violations() == []


def test_a_kept_that_raises_still_fails_the_role_s_room(engine):
    """`kept` raises: the request has ended already, yet the role's `fail` still hears of it
    (P's room fails, rather than wait for its deadline holding the pages)."""
    eng, role = engine
    outs: list[RequestOutput] = []
    a = request(eng, "a", outs)
    role.asks["admit"] = [ComputePrompt(a)]
    role.asks["take_token"] = [KeepPages(a, Event.STOP, "room 1")]
    role.raises["kept"] = RuntimeError("the room lost its lease")
    role.fails = True
    for _ in range(20):
        if outs:
            break
        eng.tick()
    assert [o.finish_reason for o in outs] == ["stop"]
    assert role.failed == ["a"]
    lease = next(what[1] for verb, what in role.seen if verb == "kept")
    assert isinstance(lease, Lease) and lease.state is LeaseState.LIVE  # the role's, to free
    lease.release()
    assert eng.pool.allocator.num_held == 0 and eng.leases.violations() == []
