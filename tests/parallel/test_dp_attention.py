"""DeepSeek-V3 and V3.2 with data-parallel attention and expert parallel (`--dp 2 --ep`):
each rank attends only the requests whose pages are in its pool, a rank with none that step
joins the MoE layers' exchanges idle, and only the leader runs the LM head, on every rank's
gathered rows (engine/dp_step.py, parallel/dp_tokens.py). Greedy tokens, logprobs and prompt
logprobs equal TP 1's on the TP tests' workload (18 prompts, chunked), with both ranks given
work and some steps where one is idle; V3 runs it twice with the prefix cache on, the second
round served from each rank's own cached pages. Through HTTP: `serve --dp 2 --ep` answers as
`serve` does, and its follower is gone when it stops; `launch --prefill 1 --decode 1 --dp 2
--ep` over shm and tcp gives the TP-1 engine's ids, with pages used on both ranks of each side.
A rank killed while it only joins the exchanges idle fails the engine within the collective
bound, naming it; a rank reading another plan is named by the digests.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine import dp_step, tp_leader
from pdserve.engine.offline import build_engine, generate
from pdserve.model.config import ModelArch
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.pids import wait_gone
from pdserve.runtime.supervisor import ThreadFatal
from tests.parallel.test_tp_engine import (
    GREEDY,
    assert_same_answers,
    failing,
    run,
    serve_args,
    submit_all,
    tp_engine,
    workload,
)
from tests.procs import LaunchedCluster, ServerProcess, http

pytestmark = pytest.mark.process  # follower ranks are processes


def same(one: list, two: list, what: str) -> None:  # type: ignore[type-arg]
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        assert a[0] == b[0], f"request {i}: {what}'s tokens differ"
        for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
            bound = 1e-4 * max(1.0, abs(x.logprob))  # float32 sums in another order
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < bound, (what, i)
        assert a[3] == b[3] == "length", i


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v32-tiny"])
def test_dp_attention_generates_what_tp1_generates(builtin_dir, name: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = builtin_dir(name)
    prompts, params = workload(ModelArch.from_dir(path).vocab_size)
    with tp_engine(path, 1) as engine:
        want = run(engine, prompts, params)
    counts: list[list[int]] = []
    real = dp_step.split

    def spy(chunks, world):  # type: ignore[no-untyped-def]
        split = real(chunks, world)
        counts.append(split.counts)
        return split

    monkeypatch.setattr(dp_step, "split", spy)
    cache = name == "deepseek-v3-tiny"
    with tp_engine(path, 2, dp_attention=True, prefix_cache=cache) as engine:
        assert engine.pool.allocator.parts == 2
        assert engine.pool.allocator.num_pages == 2 * engine.pool.num_pages
        same(want, run(engine, prompts, params), "--dp 2")
        assert all(sum(c[r] for c in counts) > 0 for r in (0, 1)), "a rank was never given work"
        assert any(0 in c for c in counts), "no step left a rank idle"
        if cache:  # again: each request's prefix is in the part it ran in
            same(want, run(engine, prompts, params), "--dp 2, cached")
            assert engine.prefix_cache is not None
            assert engine.prefix_cache.stats.hit_tokens > 0
        assert engine.leases.violations() == []


def test_serve_dp2_answers_as_serve_does(builtin_dir, tmp_path: Path) -> None:
    path = builtin_dir("deepseek-v3-tiny")
    args = {1: serve_args(path, 1), 2: [*serve_args(path, 1), "--dp", "2", "--ep"]}
    servers = {n: ServerProcess(a, tmp_path / f"{n}.log") for n, a in args.items()}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
        tp = http("GET", servers[2].url + "/info")[1]["tp"]
        assert tp["size"] == 2 and tp["data_parallel_attention"] is True and len(tp["pids"]) == 1
        assert_same_answers(servers)
        assert servers[2].stop() == 0
        assert wait_gone(tp["pids"], 10.0) == [], "the follower outlived its worker"
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pd_between_data_parallel_workers_equals_tp1(builtin_dir, tmp_path: Path, backend) -> None:  # type: ignore[no-untyped-def]
    """`launch --dp 2 --ep`: P's requests run on both its ranks, it reads each page from the
    rank that holds it; D's rooms take pages in both ranks' pools, where P writes each whole
    (kvcache/rank_pages.py `dp`). Ids equal the TP-1 engine's."""
    path = builtin_dir("deepseek-v3-tiny")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (3, 17, 40, 95, 60)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = generate(build_engine(path, kv_budget_mb=16, max_model_len=1024), prompts, params)
    flags = ["--model", str(path), "--served-model-name", "tiny", "--kv-budget-mb", "16",
             "--max-model-len", "1024", "--threads", "1", "--backend", backend]  # fmt: skip
    topology = ["--prefill", "1", "--decode", "1", "--dp", "2", "--ep"]
    with LaunchedCluster(["launch", *topology, *flags], tmp_path / "logs") as c:
        got: list[list[int] | None] = [None] * len(prompts)

        def ask(i: int) -> None:
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            status, resp = http("POST", c.url + "/v1/completions", body)
            assert status == 200, resp
            tokens = resp["choices"][0]["logprobs"]["tokens"]
            got[i] = [int(t.removeprefix("token_id:")) for t in tokens]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:  # at once, so that both ranks of each side get requests
            t.start()
        for t in threads:
            t.join(120.0)
        assert got == want
        status, doc = http("GET", c.url + "/debug/cluster")
        assert status == 200, doc
        for w in doc["workers"].values():  # the prefix cache keeps pages on both ranks
            used = w["state"]["engine"]["pool"]["pages_used_by_rank"]
            assert len(used) == 2 and min(used) > 0, (w["role"], used)


def test_a_dp_rank_that_dies_or_reads_another_plan_fails_the_engine(builtin_dir, monkeypatch):  # type: ignore[no-untyped-def]
    """One request, so rank 1 only joins the exchanges idle: killed, the leader's next
    exchange fails within the collective bound, naming it; a rank whose plan differs
    (fault point tp.recv.1) is named by the digests before any exchange."""
    path = builtin_dir("deepseek-v3-tiny")
    monkeypatch.setattr(tp_leader, "TP_COLLECTIVE_TIMEOUT_S", 3.0)
    with tp_engine(path, 2, dp_attention=True) as engine:
        assert engine.tp is not None
        outs = submit_all(engine, [[5, 6, 7, 8]], [GREEDY])
        while len(outs[0]) < 3:  # generating, on rank 0; rank 1 idle in every exchange
            engine.tick()
        os.kill(engine.tp.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ThreadFatal, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            while time.monotonic() - t0 < 20.0:
                engine.tick()
        assert time.monotonic() - t0 < 3.0 + 5.0
        assert outs[0][-1].finish_reason == "error"
    monkeypatch.setenv("PDSERVE_FAULTS", "tp.recv.1=malformed@0.2#1")
    monkeypatch.setenv("PDSERVE_FAULT_SEED", "5")
    with tp_engine(path, 2, dp_attention=True) as engine:
        why, outs, _ = failing(engine, [[5, 6, 7, 8]] * 3, within_s=20.0)
        assert re.search(r"step \d+: the plan digests differ: .* rank 1 digested", why), why
        assert all(o[-1].finish_reason == "error" for o in outs.values())
