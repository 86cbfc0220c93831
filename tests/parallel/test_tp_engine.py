"""A tensor-parallel engine on the CPU: rank 0 leads, rank 1 follows, over gloo (LESSONS #12, #21).

* TP 2 generates what TP 1 generates, token for token (greedy, float32, builtin tiny), on 18
  prompts of varied lengths, chunked, preempted (a pool of 40 pages at both TPs), with prompt
  logprobs and sampled-token logprobs.
* A follower that reads another plan (fault point `tp.recv.1=malformed`) stops the engine
  within seconds with an error naming rank 1 and the step; every request fails with it; every
  rank process is gone.
* An idle engine keeps its follower past the collective timeout (IDLE records); a follower
  killed mid-generation, or stopped (SIGSTOP, so only the collective timeout can tell), fails
  the engine loudly within the (shortened) collective timeout: no hang.
* Through HTTP: `serve --tp 2` answers chat and completions requests as `serve --tp 1` does,
  and stopping it stops its follower; a rank that reads another plan fails the request with
  the rank and the step, and the worker exits 1 with every rank's flight recorder in its log.

Every process is stopped by its pid whatever happens (`tp_engine`, `ServerProcess`).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelSpec, ServerConfig
from pdserve.engine import tp_leader
from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine
from pdserve.kvcache.layout import KVLayout
from pdserve.model.config import ModelArch
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.pids import wait_gone
from pdserve.runtime.supervisor import ThreadFatal
from tests.procs import ServerProcess, http

pytestmark = pytest.mark.process

PAGES = 40  # at both TPs: the same schedule, preemptions included
PAGE = 16


def budget_mb(path: Path, tp: int) -> float:
    """The KV budget of PAGES pages at `tp` (a rank's page holds its share of the KV heads)."""
    arch = ModelArch.from_dir(path)
    layout = KVLayout.for_model(arch.for_rank(tp, 0), "float32", PAGE, tp_rank=0, tp_size=tp)
    return PAGES * layout.page_bytes / 2**20


@contextmanager
def tp_engine(path: Path, tp: int, **kw: Any) -> Iterator[Engine]:
    """An engine at `tp`; its followers are stopped, by pid, and gone when the block ends."""
    torch.set_num_threads(1)  # two ranks on a small machine
    kw = {"max_batched_tokens": 64, "max_model_len": 512, "page_size": PAGE,
          "kv_budget_mb": budget_mb(path, tp), "prefix_cache": False, **kw}  # fmt: skip
    engine = build_engine(path, tp=tp, **kw)
    pids = engine.tp.pids if engine.tp is not None else []
    try:
        yield engine
    finally:
        if engine.tp is not None:
            engine.tp.close()
        assert wait_gone(pids, 10.0) == [], f"follower ranks {pids} outlived their engine"


Outputs = dict[int, list[RequestOutput]]
GREEDY = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def submit_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> Outputs:
    outs: Outputs = {i: [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(f"r{i}", p, sp, outs[i].append)
    return outs


def ended(outs: Outputs) -> bool:
    return all(o and o[-1].finish_reason is not None for o in outs.values())


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    """Each request's tokens, their logprobs, its prompt logprobs and finish reason."""
    outs = submit_all(engine, prompts, params)
    deadline = time.monotonic() + 120.0
    while not ended(outs):
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        engine.tick()
    return [
        (
            [t for o in got for t in o.token_ids],
            [lp for o in got for lp in o.logprobs],
            [lp for o in got for lp in o.prompt_logprobs],
            got[-1].finish_reason,
        )
        for got in outs.values()
    ]


def workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """18 prompts from 3 to 150 tokens (the longest in 3 chunks of 64), every third scoring its
    prompt, every fourth with the sampled tokens' logprobs."""
    gen = torch.Generator().manual_seed(42)
    lens = [3, 150, 17, 64, 65, 5, 90, 33, 1, 120, 48, 7, 77, 26, 140, 9, 55, 12]
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]
    params = [
        SamplingParams(
            max_tokens=6 + (i * 5) % 19,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=2 if i % 3 == 0 else None,
            logprobs=2 if i % 4 == 0 else None,
        )
        for i in range(len(lens))
    ]
    return prompts, params


def test_tp2_generates_what_tp1_generates(tiny_dir):
    vocab = ModelArch.from_dir(tiny_dir).vocab_size
    prompts, params = workload(vocab)
    got = {}
    for tp in (1, 2):
        with tp_engine(tiny_dir, tp) as engine:
            assert engine.pool.num_pages == PAGES
            got[tp] = run(engine, prompts, params)
            assert engine.metrics.preemptions._value.get() > 0, f"TP {tp} never preempted"
    for i, (one, two) in enumerate(zip(got[1], got[2], strict=True)):
        assert one[3] == two[3] == "length", i
        assert one[0] == two[0], f"request {i}: TP 2's tokens differ"
        for a, b in zip(one[1] + one[2], two[1] + two[2], strict=True):
            # float32 sums over two ranks' partials: 1e-4, relative past 1 (a -49.72 logprob
            # measured 1.07e-4 apart)
            bound = 1e-4 * max(1.0, abs(a.logprob))
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < bound, i
            assert [t for t, _ in a.top] == [t for t, _ in b.top], i
        assert len(one[2]) == (len(prompts[i]) - 1 if params[i].prompt_logprobs else 0)


def failing(
    engine: Engine, prompts: list[list[int]], within_s: float
) -> tuple[str, Outputs, float]:
    """Tick until the engine dies; its error, the outputs, and how long it took."""
    outs = submit_all(engine, prompts, [GREEDY] * len(prompts))
    t0 = time.monotonic()
    with pytest.raises(ThreadFatal) as err:
        while time.monotonic() - t0 < within_s:
            engine.tick()
    return str(err.value), outs, time.monotonic() - t0


def test_a_follower_reading_another_plan_stops_every_rank(tiny_dir, monkeypatch):
    # In the followers' environment only: this process's fault points were read at import.
    monkeypatch.setenv("PDSERVE_FAULTS", "tp.recv.1=malformed@0.2#1")
    monkeypatch.setenv("PDSERVE_FAULT_SEED", "5")
    with tp_engine(tiny_dir, 2) as engine:
        assert engine.tp is not None
        pids = engine.tp.pids
        why, outs, took = failing(engine, [[5, 6, 7, 8]] * 3, within_s=20.0)
        assert took < 10.0
        digests = (
            r"the plan digests differ: the leader \(rank 0\) sent 0x\w+, rank 1 digested 0x\w+"
        )
        m = re.search(r"step (\d+): " + digests, why)
        assert m is not None, why
        assert int(m.group(1)) > 2  # past SETUP and the first forward: mid-generation
        for got in outs.values():
            assert got[-1].finish_reason == "error" and "rank 1 digested" in (got[-1].error or "")
        assert wait_gone(pids, 5.0) == [], "a rank outlived the failure"
        assert engine.tp.closed


def test_a_follower_killed_mid_generation_fails_the_engine(tiny_dir, monkeypatch):
    bound = 3.0
    monkeypatch.setattr(tp_leader, "TP_COLLECTIVE_TIMEOUT_S", bound)
    with tp_engine(tiny_dir, 2) as engine:
        assert engine.tp is not None
        idle = time.monotonic() + bound * 1.5  # idle past the bound: the keepalive holds
        while time.monotonic() < idle:
            engine.tick()
        assert engine.tp.lockstep.step >= 4  # SETUP, then an IDLE record every bound / 4
        outs = submit_all(engine, [[5, 6, 7, 8]] * 2, [GREEDY] * 2)
        while sum(len(o) for o in outs.values()) < 6:  # generating
            engine.tick()
        os.kill(engine.tp.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(
            ThreadFatal, match=r"step \d+: rank 1 \(pid \d+\) was killed by SIGKILL"
        ):
            while time.monotonic() - t0 < 20.0:
                engine.tick()
        assert time.monotonic() - t0 < 3.0 + 5.0
        assert all(o[-1].finish_reason == "error" for o in outs.values())


def test_a_follower_that_loads_slower_than_the_collective_bound_still_starts(tiny_dir, monkeypatch):
    """SETUP, a collective, waits for every follower's loaded mark (under the join timeout):
    a follower whose load ends 4 s after rank 0's, under a 3 s collective bound, is slow, not
    hung. Before the mark, rank 0's SETUP broadcast timed out and the engine never started."""
    monkeypatch.setattr(tp_leader, "TP_COLLECTIVE_TIMEOUT_S", 3.0)
    monkeypatch.setenv("PDSERVE_FAULTS", "tp.follower.loaded=delay:4")
    with tp_engine(tiny_dir, 2) as engine:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        [(ids, _, _, reason)] = run(engine, [[5, 6, 7, 8]], [params])
        assert len(ids) == 4 and reason == "length"


def test_a_follower_that_stalls_fails_the_engine_at_the_collective_timeout(tiny_dir, monkeypatch):
    bound = 3.0
    monkeypatch.setattr(tp_leader, "TP_COLLECTIVE_TIMEOUT_S", bound)
    with tp_engine(tiny_dir, 2) as engine:
        assert engine.tp is not None
        os.kill(engine.tp.pids[0], signal.SIGSTOP)  # alive, silent: only the bound tells
        why, outs, took = failing(engine, [[5, 6, 7, 8]], within_s=30.0)
        assert re.search(r"step \d+: rank 0 could not exchange .*bound 3\.0 s", why), why
        assert bound * 0.9 <= took < bound + 5.0
        assert outs[0][-1].finish_reason == "error"
        # tp_engine's exit: the stopped rank is killed by its pid


def test_tp_is_refused_where_it_cannot_run(tiny_dir, builtin_dir):
    with pytest.raises(ValueError, match="overlapped scheduling .* needs --tp 1"):
        build_engine(tiny_dir, tp=2, overlap_schedule=True)
    spec = ModelSpec(str(tiny_dir), "tiny")
    with pytest.raises(ValueError, match="a host cache .* needs --tp 1"):
        EngineConfig(spec, CacheConfig(host_cache_bytes=2**20), tp=2)
    ServerConfig(EngineConfig(spec, tp=2), role="prefill")  # on the CPU, over shm or tcp
    with pytest.raises(ValueError, match="a decode worker at --tp 2 runs on the CPU"):
        ServerConfig(EngineConfig(ModelSpec(str(tiny_dir), "tiny", device="cuda"), tp=2),
                     role="decode")  # fmt: skip
    with pytest.raises(ValueError, match="at --tp 2 moves KV over shm or tcp"):
        ServerConfig(EngineConfig(spec, tp=2), role="decode", backend="nixl")
    with pytest.raises(ValueError, match=r"--tp\) must be in \[1, 64\]"):
        EngineConfig(spec, tp=0)
    from pdserve.model.config import ModelConfigError

    with pytest.raises(ModelConfigError, match="runs at tensor parallelism 1 only"):
        build_engine(builtin_dir("deepseek-v4-tiny"), tp=2)
    v3 = ModelArch.from_dir(builtin_dir("deepseek-v3-tiny"))  # expert parallel: experts split
    assert v3.moe is not None and v3.for_rank(2, 1) is v3
    with pytest.raises(ModelConfigError, match="n_routed_experts .* does not split over 3"):
        v3.for_rank(3, 0)


# ---------------------------------------------------------------- through HTTP


def serve_args(path: Path, tp: int) -> list[str]:
    return ["serve", "--model", str(path), "--served-model-name", "tiny", "--tp", str(tp),
            "--threads", "1", "--kv-budget-mb", "16", "--max-model-len", "512"]  # fmt: skip


ASKS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count: one two"}],
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "The quick brown fox", "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": ["a b c", "x" * 40]}),
]  # fmt: skip


def texts(answer: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in answer["choices"]]


def assert_same_answers(servers: dict[int, ServerProcess]) -> None:
    """Every ask of ASKS, greedy, gets the same texts from each server."""
    for path, body in ASKS:
        body = {"model": "tiny", "max_tokens": 12, "temperature": 0, **body}
        answers = {}
        for n, s in servers.items():
            status, answer = http("POST", s.url + path, body)
            assert status == 200, answer
            answers[n] = texts(answer)
        first = next(iter(answers.values()))
        assert all(a == first for a in answers.values()) and all(first), (path, answers)


def test_serve_tp2_answers_as_serve_tp1_does(tiny_dir, tmp_path):
    servers = {tp: ServerProcess(serve_args(tiny_dir, tp), tmp_path / f"{tp}.log") for tp in (1, 2)}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
        info = http("GET", servers[2].url + "/info")[1]
        pids = info["tp"]["pids"]
        assert info["tp"]["size"] == 2 and len(pids) == 1
        assert_same_answers(servers)
        assert http("GET", servers[2].url + "/health")[0] == 200
        assert servers[2].stop() == 0
        assert wait_gone(pids, 10.0) == [], "the follower outlived its worker"
    finally:
        for s in servers.values():
            s.stop()


def test_serve_tp2_stops_loudly_when_a_rank_reads_another_plan(tiny_dir, tmp_path):
    faults = {"PDSERVE_FAULTS": "tp.recv.1=malformed@0.3#1", "PDSERVE_FAULT_SEED": "1"}
    with ServerProcess(serve_args(tiny_dir, 2), tmp_path / "serve.log", env=faults) as srv:
        pids = http("GET", srv.url + "/info")[1]["tp"]["pids"]
        body = {"model": "tiny", "max_tokens": 60, "temperature": 0, "prompt": "a b c"}
        status, answer = http("POST", srv.url + "/v1/completions", body)
        assert status == 500, answer
        assert re.search(r"out of lockstep: step \d+: .* rank 1 digested", str(answer)), answer
        assert srv.proc is not None and srv.proc.wait(20.0) == 1  # the worker stops itself
        assert wait_gone(pids, 10.0) == []
        log = srv.log()
        assert "thread engine dead: tensor-parallel ranks out of lockstep" in log
        assert log.count("flight recorder") == 2  # each rank's, in the worker's log
