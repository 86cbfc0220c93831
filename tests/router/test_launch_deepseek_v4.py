"""DeepSeek-V4 through `pdserve launch` 1P+1D on tcp and nixl equals the co-located engine: the
compressed pages and each room's per-request state slot travel on every backend. (shm, in one
process, component by component: tests/worker/test_deepseek_v4_pd.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine.offline import build_engine, generate
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.nixl import nixl_available
from tests.engine.test_parity import prompts_for
from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

CHUNK = 96  # splits the 4- and 128-token windows and the 16-token sliding window
NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
LENGTHS = [5, 77, 131, 258, 301, 517]


@pytest.fixture(scope="module")
def v4_dir(builtin_dir) -> Path:  # type: ignore[no-untyped-def]
    return builtin_dir("deepseek-v4-tiny")


@pytest.fixture(scope="module", params=["tcp", pytest.param("nixl", marks=NIXL)])
def cluster(request, v4_dir: Path, tmp_path_factory) -> Iterator[LaunchedCluster]:  # type: ignore[no-untyped-def]
    args = ["launch", "--prefill", "1", "--decode", "1", "--backend", request.param]
    args += ["--model", str(v4_dir), "--served-model-name", "v4", "--threads", "1"]
    args += ["--kv-budget-mb", "16", "--max-model-len", "1024", "--max-running", "8"]
    args += ["--max-batched-tokens", str(CHUNK)]
    with LaunchedCluster(args, tmp_path_factory.mktemp("launch-v4")) as c:
        yield c


def test_pd_equals_colocated(cluster, v4_dir):  # type: ignore[no-untyped-def]
    prompts = prompts_for(2000, LENGTHS, seed=7)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = build_engine(v4_dir, max_batched_tokens=CHUNK, kv_budget_mb=16.0, max_running=8)
    want = generate(engine, prompts, params)

    def ask(p: list[int]) -> list[int]:
        body = {"model": "v4", "prompt": p, "max_tokens": 6, "temperature": 0}
        body |= {"ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0}
        status, resp = http("POST", cluster.url + "/v1/completions", body)
        assert status == 200, resp
        choice = resp["choices"][0]
        assert choice["finish_reason"] == "length"
        return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts))
    assert got == want
    status, metrics = http("GET", cluster.url + "/metrics")
    assert status == 200
    routed = re.search(r'pdserve_router_routed_requests_total\{mode="pd"\} (\S+)', metrics)
    assert routed is not None and float(routed.group(1)) >= len(prompts)  # P computed them
