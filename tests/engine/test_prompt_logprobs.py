"""Prompt logprobs (params.prompt_logprobs): pdserve's scores of each prompt token vs HF
float32 teacher forcing, across prefill chunks, batched with requests that do not ask, and
with max_tokens 0 (score the prompt, generate nothing)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import InvalidParams, SamplingParams
from tests.helpers import make_engine

transformers = pytest.importorskip("transformers")

TOP = 3


def hf_scores(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float32 log-probs of each next prompt token's distribution."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def drive(engine, prompts, params) -> list[list[RequestOutput]]:
    outs: list[list[RequestOutput]] = [[] for _ in prompts]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(f"plp-{time.monotonic_ns()}-{i}", p, sp, outs[i].append)
    deadline = time.monotonic() + 120
    while not all(o and o[-1].finish_reason is not None for o in outs):
        assert time.monotonic() < deadline, "requests did not finish"
        engine.tick()
    return outs


def test_prompt_logprobs_match_hf_across_chunks(tiny_dir):
    engine = make_engine(tiny_dir, page_size=8, chunk=20)  # a 45-token prompt takes 3 chunks
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 2000, (45,), generator=g).tolist()
    other = torch.randint(3, 2000, (30,), generator=g).tolist()
    scoring = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outs, others = drive(engine, [prompt, other], [scoring, plain])
    got = outs[0].prompt_logprobs
    assert all(not o.prompt_logprobs for o in outs[1:]), "only the first output carries them"
    assert all(not o.prompt_logprobs for o in others), "a request that did not ask gets none"
    ref = hf_scores(tiny_dir, prompt)
    assert [x.token_id for x in got] == prompt[1:]
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).flatten()
    assert torch.allclose(torch.tensor([x.logprob for x in got]), want, atol=1e-4, rtol=0)
    top = ref.topk(TOP, dim=-1)
    for j, x in enumerate(got):
        assert [t for t, _ in x.top] == top.indices[j].tolist()
        assert torch.allclose(torch.tensor([v for _, v in x.top]), top.values[j], atol=1e-4)
    assert engine.pool.allocator.num_held == 0


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_dir):
    engine = make_engine(tiny_dir, page_size=8, chunk=16)
    prompt = list(range(5, 25))
    (outs,) = drive(engine, [prompt], [SamplingParams(max_tokens=0, prompt_logprobs=0)])
    assert [o.token_ids for o in outs] == [()]
    assert outs[-1].finish_reason == "length"
    assert [x.token_id for x in outs[0].prompt_logprobs] == prompt[1:]
    assert all(x.top == () for x in outs[0].prompt_logprobs)
    assert engine.pool.allocator.num_held == 0


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidParams) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidParams) as e:
        SamplingParams(max_tokens=1, prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"
