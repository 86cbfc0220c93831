import math

import torch

from pdserve.engine.params import SEED_MAX, SEED_MIN, SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sampler import filter_logits, sample


def r(**kw) -> Request:
    return Request(
        "r", [1, 2], SamplingParams(**kw), sink=lambda o: None, eos_token_ids=frozenset({0})
    )


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, 0.0], [5.0, 0.0, 0.0, 0.0]])
    ids, _ = sample(logits, [r(temperature=0), r(temperature=0, min_tokens=0)])
    assert ids == [1, 0]


def test_seed_reproducible_and_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    a = [sample(logits[1:2].clone(), [r(temperature=1.0, seed=42)])[0][0] for _ in range(1)]
    runs = []
    for _ in range(2):
        req = r(temperature=1.0, seed=42)
        seq = [sample(logits[1:2].clone(), [req])[0][0] for _ in range(20)]
        runs.append(seq)
    assert runs[0] == runs[1]
    batch_req = r(temperature=1.0, seed=42)
    batched = [
        sample(logits.clone(), [r(temperature=1.0), batch_req, r(temperature=0)])[0][1]
        for _ in range(20)
    ]
    assert batched == runs[0] and batched[0] == a[0]
    assert len(set(runs[0])) > 1  # it really samples


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **kw: torch.isfinite(filter_logits(logits.clone(), [r(**kw)]))[0].tolist()
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.8) == [True, True, False, False]
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(min_p=0.5) == [True, True, False, False]
    assert keep(top_p=0.01) == [True, False, False, False]


def test_filtered_draws_stay_in_the_kept_set():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    req = r(temperature=1.0, top_k=2, seed=3)
    assert {sample(logits.clone(), [req])[0][0] for _ in range(200)} == {0, 1}


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    req = r(temperature=0, repetition_penalty=2.0)
    req.prompt_ids = [0, 2]
    ids, _ = sample(logits.clone(), [req])
    assert ids == [1]  # token 0 halved to 1.0, token 1 keeps 2.0
    req2 = r(temperature=0, presence_penalty=1.5)
    req2.output_ids = [1]
    assert sample(torch.tensor([[2.0, 3.0, 0.0, 0.0]]), [req2])[0] == [0]
    req3 = r(temperature=0, frequency_penalty=0.6)
    req3.output_ids = [1, 1]
    assert sample(torch.tensor([[2.0, 3.0, 0.0, 0.0]]), [req3])[0] == [0]  # 3 - 1.2 < 2


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    req = r(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sample(logits.clone(), [req])[0] == [1]
    req.output_ids = [1, 1]
    assert sample(logits.clone(), [req])[0] == [0]


def test_logprobs_are_raw_and_top_sorted():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    ids, lps = sample(logits.clone(), [r(temperature=0, logprobs=2)])
    ref = torch.log_softmax(logits[0], -1)
    assert ids == [2] and math.isclose(lps[0].logprob, float(ref[2]), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [2, 1]


def test_tiny_temperature_is_greedy_and_top_k_past_the_vocab_keeps_everything():
    # logits / 1e-40 overflow float32 to inf, and a softmax over several infs is NaN, which
    # torch.multinomial refuses: such a temperature must take the greedy path.
    logits = torch.tensor([[0.1, 3.0, 2.9, 0.0], [1.0, 0.0, 0.0, 0.5]])
    ids, _ = sample(logits.clone(), [r(temperature=1e-40), r(temperature=1e-6, seed=1)])
    assert ids == [1, 0]
    huge_k = r(temperature=1.0, top_k=2**31 - 1, seed=5)
    assert torch.isfinite(filter_logits(logits[:1].clone(), [huge_k])).all()
    drawn = {sample(torch.zeros(1, 4), [huge_k])[0][0] for _ in range(200)}
    assert drawn == {0, 1, 2, 3}


def test_seeds_at_the_edges_of_the_accepted_range_sample():
    logits = torch.zeros(1, 8)
    for seed in (SEED_MIN, -1, SEED_MAX):
        assert 0 <= sample(logits.clone(), [r(temperature=1.0, seed=seed)])[0][0] < 8
