"""DeepSeek-V4 co-located with fp8 KV (`--kv-dtype fp8`): greedy tokens the same whatever the
prefill chunks and batch, and close to the float32 KV's run on the issue's prompt lengths
(a quantised indexer key may flip an entry the tiny model's near-tie scores keep); every page
and state slot back in the pool after."""

from __future__ import annotations

import pytest

from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_deepseek_v4_engine import empty
from tests.engine.test_parity import prompts_for
from tests.helpers import make_engine, run

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LENGTHS = [5, 77, 131, 258, 301, 517]
# The lengths whose 16 tokens equal the float32 KV's exactly (the others part at tokens 10 and
# 1: an indexer key's quantisation flips one of its top-k picks).
EXACT = [5, 131, 301, 517]


@pytest.fixture(scope="module")
def v4_dir(builtin_dir):  # type: ignore[no-untyped-def]
    return builtin_dir("deepseek-v4-tiny")


def test_fp8_greedy_is_stable_and_close_to_float32(v4_dir) -> None:  # type: ignore[no-untyped-def]
    prompts = prompts_for(2000, LENGTHS, seed=4)
    together = make_engine(v4_dir, chunk=509, max_running=8, kv_mb=64, kv_dtype="fp8")
    assert together.pool.layout.buffer("csa.kv").dtype == "float8_e4m3fn"
    got = run(together, prompts, GREEDY)
    chunked = make_engine(v4_dir, chunk=64, max_running=8, kv_mb=64, kv_dtype="fp8")
    assert run(chunked, prompts, GREEDY) == got  # other chunks beside other decodes
    assert run(chunked, prompts[3:4], GREEDY)[0] == got[3]  # alone
    f32 = run(make_engine(v4_dir, chunk=509, max_running=8, kv_mb=64), prompts, GREEDY)
    exact = [n for n, a, b in zip(LENGTHS, got, f32, strict=True) if a == b]
    assert exact == EXACT
    assert all(a[0] == b[0] for a, b in zip(got, f32, strict=True))
    assert empty(together) and empty(chunked)
