"""Issue 17's reproductions against a live prefill/decode pair: nothing stops the cluster.

A stranger on P's control port cannot make P touch a file (or a live decode pool); a member
with the key can name only a pdserve pool; the requests that used to kill a worker's control
or engine thread are refused, and afterwards the pair serves the same tokens as before, with
every thread alive and never restarted.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import rank_layout
from pdserve.protocol import messages as m
from pdserve.protocol.layout_desc import LayoutDesc
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.timing import PEER_TIMEOUT_S, PING_EVERY_S
from pdserve.transfer.control import Control, Inbound
from tests.helpers import OpenZap, join_as_member
from tests.pd.conftest import CHUNK, PD, tokens
from tests.procs import ServerProcess, http, worker_args

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

PROMPT = list(range(5, 5 + CHUNK + 7))
REPEAT = 8  # more than the supervisor's restart budget (5): a dying thread would show


@pytest.fixture(scope="module")
def pd(tiny_dir, tmp_path_factory) -> Iterator[PD]:
    logs = tmp_path_factory.mktemp("pd-hostile")
    common = worker_args(tiny_dir, "shm", CHUNK)
    with (
        ServerProcess(["serve", "--role", "prefill", *common], logs / "p.log") as p,
        ServerProcess(["serve", "--role", "decode", *common], logs / "d.log") as d,
    ):
        control = http("GET", p.url + "/info")[1]["control"]
        yield PD(p, d, control, "shm")


@pytest.fixture(scope="module")
def baseline(pd: PD) -> list[int]:
    return tokens(pd.generate("baseline", PROMPT))


class Member:
    """A client of P's control port that holds the cluster key (an insider, or a test)."""

    def __init__(self, address: str, name: str) -> None:
        self.address = address
        self.got: list[m.Msg] = []
        key = ClusterKey.from_env(None)
        assert key is not None  # tests/conftest.py gives the run a key
        self.control = Control(name, self._on, lambda *a: None, key)

    def _on(self, inbound: Inbound) -> None:
        self.got.append(inbound.msg)

    def ask(self, msg: m.Msg, want: type, n: int = 1, timeout_s: float = 10.0) -> list:
        self.control.send(self.address, msg)
        deadline = time.monotonic() + timeout_s
        while len([x for x in self.got if isinstance(x, want)]) < n:
            assert time.monotonic() < deadline, f"no {want.__name__} from P: {self.got}"
            self.control.tick()
        return [x for x in self.got if isinstance(x, want)]

    def close(self) -> None:
        self.control.close()


def threads_unhurt(url: str) -> None:
    state = http("GET", url + "/debug/state", timeout=10)[1]
    assert all(t["alive"] and t["crashes"] == 0 for t in state["threads"]), state["threads"]
    assert http("GET", url + "/health")[0] == 200


def serving_as_before(pd: PD, baseline: list[int]) -> None:
    assert tokens(pd.generate(f"after-{time.monotonic_ns()}", PROMPT)) == baseline
    pd.wait_quiet()
    threads_unhurt(pd.p.url)
    threads_unhurt(pd.d.url)


def p_role(pd: PD) -> dict:
    return http("GET", pd.p.url + "/debug/state", timeout=10)[1]["engine"]["role"]


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "victim"
    path.write_bytes(b"precious" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        yield path, fd
    finally:
        os.close(fd)


def shm_register(layout: dict, rank0: m.ShmPool, tp: int, others: list[m.ShmPool]) -> m.Register:
    return m.Register(layout=layout, backend="shm", shm=rank0, num_pages=64, tp=tp, rank_shm=others)  # type: ignore[arg-type]


def layout_of(pd: PD) -> dict:
    return http("GET", pd.p.url + "/info")[1]["layout"]


def test_a_stranger_cannot_make_p_write_a_file(pd, baseline, victim):
    path, fd = victim
    before = p_role(pd)["control"]["dropped"].get("auth_missing", 0)
    evil = zmq.Context.instance().socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.setsockopt(zmq.IDENTITY, b"stranger")
    # One who learned the handshake (PLAIN's password crosses the wire) but not the key: its
    # frames reach P, which drops them unread. Without the handshake: test_a_stranger_is_...
    join_as_member(evil, cluster_key())
    evil.connect(pd.control)
    try:
        ref = m.ShmPool(pid=os.getpid(), fd=fd, token="0" * 32)
        register = m.Register(layout=layout_of(pd), backend="shm", shm=ref, num_pages=64)
        request = m.PrefillRequest(
            room=1, prompt_ids=[1, 2, 3], dst_pages=[0], params={}, write_deadline=time.time() + 30
        )
        for msg in (register, request):
            evil.send_multipart([m.encode(msg)])
        deadline = time.monotonic() + 10
        while p_role(pd)["control"]["dropped"].get("auth_missing", 0) < before + 2:
            assert time.monotonic() < deadline, p_role(pd)["control"]
            time.sleep(0.05)
    finally:
        evil.close(0)
    role = p_role(pd)
    assert "stranger" not in [p["identity"] for p in role["peers"]]
    assert path.read_bytes() == b"precious" * 4096
    serving_as_before(pd, baseline)


def cluster_key() -> ClusterKey:
    key = ClusterKey.from_env(None)
    assert key is not None  # tests/conftest.py gives the run a key
    return key


def test_a_stranger_is_refused_at_the_handshake(pd, baseline):
    """Without a member's handshake (transfer/control_handshake.py) a socket never gets a
    frame to P's Python: one without any fails at ZMQ's greeting, one with another cluster's
    password is refused by P (counted); no frame at all arrives, and P serves on."""
    before = p_role(pd)["control"]["dropped"]
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.IDENTITY, b"stranger")
    wrong = zmq.Context.instance().socket(zmq.DEALER)
    wrong.setsockopt(zmq.LINGER, 0)
    join_as_member(wrong, ClusterKey(secrets.token_bytes(32)))
    stranger.connect(pd.control)
    wrong.connect(pd.control)
    try:
        deadline = time.monotonic() + 10  # the handshake is the connection's: no send needed
        while p_role(pd)["control"]["dropped"].get("handshake_refused", 0) <= before.get(
            "handshake_refused", 0
        ):
            assert time.monotonic() < deadline, p_role(pd)["control"]
            time.sleep(0.05)
        assert not stranger.poll(300) and not wrong.poll(10)
    finally:
        stranger.close(0)
        wrong.close(0)
    after = p_role(pd)["control"]["dropped"]
    assert {k: v for k, v in after.items() if k != "handshake_refused"} == {
        k: v for k, v in before.items() if k != "handshake_refused"
    }
    serving_as_before(pd, baseline)


def test_a_member_can_name_only_a_pdserve_pool(pd, baseline, victim):
    path, fd = victim
    d_pid = http("GET", pd.d.url + "/info")[1]["pid"]
    member = Member(pd.control, "member-" + secrets.token_hex(3))
    try:
        layout = layout_of(pd)
        refs = [
            m.ShmPool(pid=os.getpid(), fd=fd, token="0" * 32),  # any file of ours
            *(m.ShmPool(pid=d_pid, fd=n, token="0" * 32) for n in range(3, 20)),  # D's pool?
        ]
        for i, ref in enumerate(refs):
            acks = member.ask(
                m.Register(layout=layout, backend="shm", shm=ref, num_pages=64),
                m.RegisterAck,
                i + 1,
            )
            assert not acks[-1].ok and str(path) not in (acks[-1].error or "")
        # A decode worker's tensor parallelism out of range, or pools that do not match it:
        # rank 0's a real pool of ours, of its rank's size, the other rank's not.
        whole = KVLayout.from_desc(msgspec.convert(layout, LayoutDesc))
        mine = KVPool(rank_layout(whole, 2, 0), 64, torch.device("cpu"), shared=True)
        assert mine.shm is not None
        ours = m.ShmPool(pid=mine.shm.pid, fd=mine.shm.fd, token=mine.shm.token)
        hostile = [
            (m.Register(layout=layout, backend="tcp", num_pages=64, tp=0), "tensor parallelism"),
            (m.Register(layout=layout, backend="tcp", num_pages=64, tp=65), "1 to 64"),
            (m.Register(layout=layout, backend="tcp", num_pages=64, dp=True), "2 or more ranks"),
            (shm_register(layout, ours, 2, []), "2 ranks"),
            (shm_register(layout, ours, 2, [ours]), "one pool twice"),
            (shm_register(layout, ours, 3, [refs[1], refs[2]]), "neither split"),
            (shm_register(layout, ours, 2, [refs[1]]), "pdserve KV pool"),  # last: checked below
        ]
        for j, (reg, why) in enumerate(hostile, start=len(refs) + 1):
            acks = member.ask(reg, m.RegisterAck, j)
            assert not acks[-1].ok and why in (acks[-1].error or ""), acks[-1]
        rejects = member.ask(
            m.PrefillRequest(
                room=7,
                prompt_ids=PROMPT,
                dst_pages=list(range(8)),
                params={},
                write_deadline=time.time() + 30,
            ),
            m.PrefillReject,
        )
        assert rejects[0].unregistered
    finally:
        member.close()
    refused = p_role(pd)["registrations_refused"]
    assert len(refused) >= 1 and all(str(path) not in r["why"] for r in refused)
    assert "pdserve KV pool" in refused[-1]["why"]
    assert path.read_bytes() == b"precious" * 4096
    serving_as_before(pd, baseline)


def _generate_raw(pd: PD, body: dict) -> tuple[int, object]:
    return http("POST", pd.d.url + "/generate", body, timeout=30)


@pytest.mark.parametrize(
    "change",
    [
        {"prefill": [1]},
        {"prefill": "file:///etc/passwd"},
        {"params": {"max_tokens": 4, "stop_token_ids": [1180591620717411303424]}},
        {"params": {"max_tokens": 4, "top_k": 2**64}},
        {"params": {"max_tokens": 4, "seed": "x"}},
        {"params": {"max_tokens": 4, "temperature": float("nan")}},
        {"timeout_s": float("nan")},
        {"timeout_s": -1},
    ],
    ids=lambda c: str(c)[:40],
)
def test_hostile_generate_bodies_are_refused(pd, baseline, change):
    for i in range(REPEAT):
        body = {
            "request_id": f"hostile-{i}-{time.monotonic_ns()}",
            "prompt_ids": [3, 4, 5],
            "params": {"max_tokens": 4},
            "prefill": pd.control,
            **change,
        }
        status, reply = _generate_raw(pd, body)
        assert status == 400, reply
        assert isinstance(reply, dict) and reply["error"]["type"] == "invalid_request_error"
    serving_as_before(pd, baseline)


def test_hostile_prefill_requests_are_rejected(pd, baseline):
    member = Member(pd.control, "member-" + secrets.token_hex(3))
    try:
        acks = member.ask(
            m.Register(layout=layout_of(pd), backend="tcp", num_pages=64), m.RegisterAck
        )
        assert acks[0].ok, acks
        soon = time.time() + 30
        bad = [
            {"params": {"seed": "x"}},
            {"params": {"top_k": 2**63}},
            {"params": {"temperature": "hot"}},
            {"params": {"stop_token_ids": [-1]}},
            {"prompt_ids": [10**6]},
            {"prompt_ids": []},
            {"dst_pages": [10**9]},
            {"write_deadline": float("nan")},
            {"write_deadline": float("inf")},
        ]
        for i, change in enumerate(bad * 1):
            fields = {
                "room": 100 + i,
                "prompt_ids": PROMPT,
                "dst_pages": list(range(8)),
                "params": {"max_tokens": 1},
                "write_deadline": soon,
                **change,
            }
            rejects = member.ask(m.PrefillRequest(**fields), m.PrefillReject, i + 1)
            assert rejects[-1].room == 100 + i, (change, rejects[-1])
        for i in range(REPEAT):  # the seed that used to kill P's engine thread, past its budget
            member.ask(
                m.PrefillRequest(
                    room=200 + i,
                    prompt_ids=PROMPT,
                    dst_pages=list(range(8)),
                    params={"seed": "x"},
                    write_deadline=soon,
                ),
                m.PrefillReject,
                len(bad) + i + 1,
            )
    finally:
        member.close()
    serving_as_before(pd, baseline)


def _last_line(reply: object) -> dict:
    if isinstance(reply, dict):
        return reply
    assert isinstance(reply, str), reply
    return json.loads(reply.strip().splitlines()[-1])


def test_a_keyless_prefill_address_gets_no_register_and_is_not_pinged(pd, baseline):
    """Issue 41 item 5: /generate names a plain ROUTER socket without the cluster key. It hears
    one Hello (no pool reference, no NIXL metadata), no Register and no Ping; the request fails
    once D declares it dead, and a second request naming it is refused at once."""
    # It takes any PLAIN password: D's handshake reaches it, as it would a relay's; what it
    # cannot do is sign a HelloAck.
    zap = OpenZap()
    fake = zap.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    got: list[m.Msg] = []
    answers: dict[str, tuple[int, object]] = {}

    def ask(rid: str) -> None:
        body = {"request_id": rid, "prompt_ids": [3, 4, 5], "params": {"max_tokens": 2}}
        answers[rid] = _generate_raw(pd, {**body, "prefill": address})

    first = threading.Thread(target=ask, args=("keyless-1",), daemon=True)
    first.start()
    try:
        # The dead-peer bound and three ping periods after it: a ping would have come by then.
        t_end = time.monotonic() + PEER_TIMEOUT_S + 3 * PING_EVERY_S + 1.0
        while time.monotonic() < t_end:
            if fake.poll(100):
                parts = fake.recv_multipart()  # [D's identity, auth, body]
                msg = m.decode(parts[2])
                assert not isinstance(msg, m.DecodeError), msg
                got.append(msg)
        first.join(10)
        ask("keyless-2")  # within the backoff: refused without a word to the fake
        assert not fake.poll(500)
    finally:
        fake.close(0)
        zap.close()
    assert [type(g).__name__ for g in got] == ["Hello"], got
    status, reply = answers["keyless-1"]
    last = _last_line(reply)
    assert status == 200 and last["finish_reason"] == "error" and "died" in last["error"], last
    status, reply = answers["keyless-2"]
    last = _last_line(reply)
    assert last["finish_reason"] == "error" and "did not prove" in last["error"], last
    peers = http("GET", pd.d.url + "/debug/state")[1]["engine"]["role"]["peers"]
    assert all(not p["proven"] for p in peers if p["address"] == address), peers
    assert all(p["proven"] for p in peers if p["address"] == pd.control), peers
    serving_as_before(pd, baseline)
