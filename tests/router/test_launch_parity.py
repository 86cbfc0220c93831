"""The parity suite: greedy text through `pdserve launch` equals the co-located engine's, for
64 concurrent requests of mixed lengths (some longer than a prefill chunk), on every KV backend
and topology: 1P+1D on shm, tcp and nixl, 2P+2D (the router spreading both legs); afterwards
every worker is quiet. (In one process, without sockets: tests/worker/test_roles.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.nixl import nixl_available
from tests.helpers import make_engine, run
from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

CHUNK = 48
NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")


@pytest.fixture(
    scope="module",
    params=[
        (1, 1, "shm"),
        (1, 1, "tcp"),
        pytest.param((1, 1, "nixl"), marks=NIXL),
        (2, 2, "tcp"),
    ],
    ids=["1p1d-shm", "1p1d-tcp", "1p1d-nixl", "2p2d-tcp"],
)
def cluster(request, tiny_dir: Path, tmp_path_factory) -> Iterator[LaunchedCluster]:
    n_p, n_d, backend = request.param
    args = [
        "launch",
        "--prefill",
        str(n_p),
        "--decode",
        str(n_d),
        "--backend",
        backend,
        "--model",
        str(tiny_dir),
        "--served-model-name",
        "tiny",
        "--kv-budget-mb",
        "16",
        "--max-model-len",
        "1024",
        "--max-batched-tokens",
        str(CHUNK),
        "--threads",
        "1",
    ]
    with LaunchedCluster(args, tmp_path_factory.mktemp("launch-parity")) as c:
        yield c


def test_64_concurrent_mixed_requests_equal_colocated(cluster, tiny_dir):
    g = torch.Generator().manual_seed(21)
    lengths = torch.randint(1, 3 * CHUNK + 10, (64,), generator=g).tolist()
    lengths[:3] = [CHUNK, CHUNK + 1, 2 * CHUNK + 7]
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]
    ids = run(
        make_engine(tiny_dir, chunk=CHUNK),
        prompts,
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    )
    tok = Tokenizer.from_dir(tiny_dir)
    # The API drops an unfinished UTF-8 character at the end, as vLLM does (frontend/textstream.py)
    want = [tok.decode(x).rstrip("\ufffd") for x in ids]

    def ask(p: list[int]) -> str:
        status, body = http(
            "POST",
            cluster.url + "/v1/completions",
            {"model": "tiny", "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 10
        return body["choices"][0]["text"]

    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(ask, prompts))
    bad = [i for i in range(64) if got[i] != want[i]]
    assert not bad, f"{len(bad)} of 64 differ (prompt lengths {[lengths[i] for i in bad[:5]]})"

    deadline = time.monotonic() + 30
    for url in cluster.worker_urls():
        while not (inv := http("GET", url + "/debug/invariants")[1])["ok"]:
            assert time.monotonic() < deadline, f"{url}: {inv}"
            time.sleep(0.1)


SEEDED = [  # (OpenAI fields, the engine's SamplingParams) of one request each
    ({"temperature": 1.0, "top_k": 40}, {"temperature": 1.0, "top_k": 40}),
    (
        {"temperature": 0.8, "top_p": 0.9, "min_p": 0.02},
        {"temperature": 0.8, "top_p": 0.9, "min_p": 0.02},
    ),
    (
        {"temperature": 1.1, "logit_bias": {"5": 4.0, "17": -100}},
        {"temperature": 1.1, "logit_bias": ((5, 4.0), (17, -100.0))},
    ),
    (
        {"temperature": 0.9, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
        {"temperature": 0.9, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
    ),
    ({"temperature": 1.0, "presence_penalty": 1.0}, {"temperature": 1.0, "presence_penalty": 1.0}),
]


def test_seeded_sampling_equals_colocated_over_20_seeds(cluster, tiny_dir):
    """One sampling rule for both modes (issue 14 part 2) on every backend: P samples the first
    token and D the rest by (seed, position), so the text equals the co-located engine's."""
    prompts = [[(13 * i + 7 * j) % 3000 + 3 for j in range(5 + 9 * (i % 4))] for i in range(20)]
    asked = [SEEDED[s % len(SEEDED)] for s in range(20)]
    params = [
        SamplingParams(max_tokens=8, seed=s, ignore_eos=True, **engine_side)
        for s, (_, engine_side) in enumerate(asked)
    ]
    tok = Tokenizer.from_dir(tiny_dir)
    want = [tok.decode(x) for x in run(make_engine(tiny_dir, chunk=CHUNK), prompts, params)]

    def ask(s: int) -> str:
        body = {"model": "tiny", "prompt": prompts[s], "max_tokens": 8, "seed": s}
        body |= {"ignore_eos": True, **asked[s][0]}
        status, resp = http("POST", cluster.url + "/v1/completions", body)
        assert status == 200, resp
        return resp["choices"][0]["text"]

    with ThreadPoolExecutor(20) as pool:
        got = list(pool.map(ask, range(20)))
    assert [s for s in range(20) if got[s] != want[s]] == []


def test_min_tokens_bans_a_stop_id_on_the_prefill_workers_token_too(cluster, tiny_dir):
    """min_tokens with stop_token_ids equal to the greedy first token: the ban applies to the
    token P samples exactly as on a co-located worker, on every backend (issue 14 part 2)."""
    prompts = [[(11 * i + 5 * j) % 3000 + 3 for j in range(6 + 7 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    firsts = [ids[0] for ids in run(make_engine(tiny_dir, chunk=CHUNK), prompts, greedy)]
    params = [
        SamplingParams(max_tokens=8, temperature=0, min_tokens=2, stop_token_ids=(f,))
        for f in firsts
    ]
    tok = Tokenizer.from_dir(tiny_dir)
    want = []
    for ids, f in zip(
        run(make_engine(tiny_dir, chunk=CHUNK), prompts, params), firsts, strict=True
    ):
        assert ids[0] != f  # the ban changed the first token
        want.append(tok.decode(ids[:-1] if ids[-1] == f else ids))  # a stop id shows no text
    for p, f, w in zip(prompts, firsts, want, strict=True):
        body = {"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0}
        body |= {"min_tokens": 2, "stop_token_ids": [f]}
        status, resp = http("POST", cluster.url + "/v1/completions", body)
        assert status == 200, resp
        assert resp["choices"][0]["text"] == w
