"""PD specifics on every backend: one-token requests, logprobs through PrefillDone, the local
fallback, and KV bytes conserved. Greedy parity over 64 mixed requests on every backend and
topology is one suite: tests/router/test_launch_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.pd.conftest import CHUNK, tokens
from tests.procs import http as call

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3 * CHUNK + 20, (n,), generator=g).tolist()
    lengths[:4] = [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1]
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]


def test_one_token_and_logprobs_and_local_fallback(pd, tiny_dir):
    prompt = mixed_prompts(1, seed=5)[0]
    one = pd.generate(f"one-{pd.backend}", prompt, max_tokens=1)
    assert len(tokens(one)) == 1 and one[-1]["finish_reason"] == "length"
    with_lp = pd.generate(f"lp-{pd.backend}", prompt, max_tokens=3, logprobs=2)
    # One logprobs entry per token; a line may carry several tokens when the stream merged
    # what waited (a loop behind under load), never a token without its entry.
    lines = [ln for ln in with_lp if ln["token_ids"]]
    assert [len(ln["logprobs"]) for ln in lines] == [len(ln["token_ids"]) for ln in lines]
    assert sum(len(ln["logprobs"]) for ln in lines) == 3
    local = pd.generate(f"loc-{pd.backend}", prompt, max_tokens=3, prefill=False)
    assert tokens(local) == tokens(with_lp)
    pd.wait_quiet()


def test_kv_bytes_are_conserved(pd):
    """What P wrote is what it reported to D in PrefillDone (and, on tcp/nixl, what D received)."""
    prompts = mixed_prompts(8, seed=3)
    before_p = call("GET", pd.p.url + "/debug/state")[1]["engine"]["role"]["stats"]
    before_d = call("GET", pd.d.url + "/debug/state")[1]["engine"]["role"]["stats"]
    for i, p in enumerate(prompts):
        tokens(pd.generate(f"bytes-{pd.backend}-{i}", p, max_tokens=2))
    pd.wait_quiet()
    p_stats = call("GET", pd.p.url + "/debug/state")[1]["engine"]["role"]["stats"]
    d_stats = call("GET", pd.d.url + "/debug/state")[1]["engine"]["role"]["stats"]
    layout = call("GET", pd.p.url + "/info")[1]["layout"]
    # Counted from the buffers (float32 K and V per layer; the tiny model's regions are
    # already 64-byte multiples, so there is no alignment padding), not from page_bytes.
    assert [b["dtype"] for b in layout["buffers"]] == ["float32", "float32"]
    per_token = sum(math.prod(b["shape"]) * 4 for b in layout["buffers"])
    page_bytes = per_token * layout["page_size"] * layout["num_layers"]
    expected = sum(-(-len(p) // layout["page_size"]) for p in prompts) * page_bytes
    written = p_stats["bytes_written"] - before_p["bytes_written"]
    acked = d_stats["bytes_acked"] - before_d["bytes_acked"]
    assert written == acked == expected
    if pd.backend in ("tcp", "nixl"):
        assert d_stats["bytes_written"] - before_d["bytes_written"] == expected
