"""PD between tensor-parallel layouts (kvcache/rank_pages.py): `launch --prefill-tp 2
--decode-tp 2` over shm, so that P reads every page whole from its two ranks' pools and writes
it into each of D's two ranks' pools, head by head. Its greedy ids equal the TP-1 engine's,
the pages P wrote are the whole model's, and both workers report their ranks.

The six layouts of issue 42 ((2,1), (1,2), (2,2) over shm and tcp, 64 prompts) are measured by
`benchmarks/serving/pd_cuda.py --device cpu --prefill-tp A --decode-tp B` (RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.layout import KVLayout
from pdserve.model.config import ModelArch
from pdserve.protocol.sampling import SamplingParams
from tests.procs import LaunchedCluster, http

pytestmark = pytest.mark.process  # it starts a cluster (tests/conftest.py)

NEW = 12


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(42)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (3, 17, 40, 95)]


def test_pd_from_two_ranks_into_two_ranks_equals_tp1(tiny_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    want = generate(build_engine(tiny_dir, kv_budget_mb=16, max_model_len=1024), prompts(), params)
    flags = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--kv-budget-mb", "16",
             "--max-model-len", "1024", "--threads", "1", "--backend", "shm"]  # fmt: skip
    topology = ["--prefill", "1", "--decode", "1", "--prefill-tp", "2", "--decode-tp", "2"]
    with LaunchedCluster(["launch", *topology, *flags], tmp_path / "logs") as c:
        got = []
        for p in prompts():
            body = {"model": "tiny", "prompt": p, "max_tokens": NEW, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            status, resp = http("POST", c.url + "/v1/completions", body)
            assert status == 200, resp
            tokens = resp["choices"][0]["logprobs"]["tokens"]
            got.append([int(t.removeprefix("token_id:")) for t in tokens])
        assert got == want
        status, doc = http("GET", c.url + "/debug/cluster")
        assert status == 200, doc
        workers = doc["workers"]
        [p_state] = [w["state"] for w in workers.values() if w["role"] == "prefill"]
        whole = KVLayout.for_model(ModelArch.from_dir(tiny_dir), "float32", 16)
        pages = sum(-(-len(p) // 16) for p in prompts())
        # every prompt's pages moved whole (the model's every KV head), none twice
        assert p_state["engine"]["role"]["stats"]["bytes_written"] == pages * whole.page_bytes
        tps = {w["role"]: (w.get("info") or {}).get("tp") for w in doc["router"]["workers"]}
        assert {role: tp["size"] for role, tp in tps.items()} == {"prefill": 2, "decode": 2}
