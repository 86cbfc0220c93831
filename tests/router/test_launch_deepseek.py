"""DeepSeek-V3.2 through `pdserve launch` 1P+1D on tcp and nixl equals the co-located engine
(issue 16 part 4): the latent and index-K pages travel by the typed layout on every backend.
(shm, in one process, both index-K modes: tests/worker/test_deepseek_v32_pd.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine.offline import build_engine, generate
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.nixl import nixl_available
from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

CHUNK = 16
NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")


@pytest.fixture(scope="module")
def v32_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v32-tiny")


@pytest.fixture(scope="module", params=["tcp", pytest.param("nixl", marks=NIXL)])
def cluster(request, v32_dir: Path, tmp_path_factory) -> Iterator[LaunchedCluster]:
    args = ["launch", "--prefill", "1", "--decode", "1", "--backend", request.param]
    args += ["--model", str(v32_dir), "--served-model-name", "v32", "--threads", "1"]
    args += ["--kv-budget-mb", "8", "--max-model-len", "256", "--page-size", "4"]
    args += ["--max-batched-tokens", str(CHUNK)]
    with LaunchedCluster(args, tmp_path_factory.mktemp("launch-v32")) as c:
        yield c


def test_pd_equals_colocated(cluster, v32_dir):
    # Lengths around the page (4) and chunk (16) boundaries and past index_topk (12): the
    # indexer's sparse selection reads index-K pages that P wrote.
    lengths = [1, 4, 5, 12, 15, 17, 33, 40]
    prompts = [[(7 * n + 3 * j) % 400 + 3 for j in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = build_engine(v32_dir, page_size=4, max_batched_tokens=CHUNK, kv_budget_mb=8.0)
    want = generate(engine, prompts, params)

    def ask(p: list[int]) -> dict:
        body = {"model": "v32", "prompt": p, "max_tokens": 6, "temperature": 0}
        body["ignore_eos"] = True
        status, resp = http("POST", cluster.url + "/v1/completions", body)
        assert status == 200, resp
        return resp["choices"][0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts))
    assert all(g["finish_reason"] == "length" for g in got)
    tok = Tokenizer.from_dir(v32_dir)
    # The API drops an unfinished UTF-8 character at the end (frontend/textstream.py)
    assert [g["text"] for g in got] == [tok.decode(ids).rstrip("\ufffd") for ids in want]
