"""DeepSeek-V4 on a GPU, the torch path (issue 40 item 7): greedy parity with HF (float32, on
the CPU) on the issue's prompt lengths, alone and batched, bf16 and fp8 KV running, and the
prefix cache resuming a conversation as an engine without it would."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.offline import build_engine, generate
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_parity import prompts_for
from tests.helpers import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LENGTHS = [5, 77, 131, 258, 301, 517]


def engine(path, **kw):  # type: ignore[no-untyped-def]
    return build_engine(
        path, device="cuda", max_batched_tokens=128, kv_budget_mb=64, max_running=8, **kw
    )


def test_greedy_matches_hf_on_the_gpu(builtin_dir):  # type: ignore[no-untyped-def]
    path = builtin_dir("deepseek-v4-tiny")
    prompts = prompts_for(2000, LENGTHS, seed=4)
    want = hf_greedy(path, prompts, 16)
    e = engine(path)
    assert [generate(e, [p], GREEDY)[0] for p in prompts] == want
    assert generate(e, prompts, GREEDY) == want  # batched, and resumed from the cache
    fp8 = generate(engine(path, kv_dtype="fp8"), prompts, GREEDY)
    assert sum(a == b for a, b in zip(fp8, want, strict=True)) >= 3


def test_bf16_runs_and_the_cache_changes_nothing(builtin_dir):  # type: ignore[no-untyped-def]
    path = builtin_dir("deepseek-v4-tiny")
    (first,) = prompts_for(2000, [300], seed=8)
    cached, plain = (
        engine(path, dtype="bfloat16"),
        engine(path, dtype="bfloat16", prefix_cache=False),
    )
    reply = generate(cached, [first], GREEDY)[0]
    second = first + reply + prompts_for(2000, [45], seed=9)[0]
    assert generate(cached, [second], GREEDY) == generate(plain, [second], GREEDY)
