"""The batched sampler: greedy parity with a per-row reference, draws keyed by (seed, position)
and nothing else, the filters, logit_bias, penalties, min_tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.isolation import sample_each
from pdserve.engine.request import Request
from pdserve.engine.sampler import sample
from pdserve.engine.sampling.batch import SamplingBatch
from pdserve.engine.sampling.processors import apply_penalties
from pdserve.protocol.sampling import SEED_MAX, SEED_MIN, SamplingParams

EOS = 0


def r(prompt: list[int] | None = None, out: list[int] | None = None, **kw) -> Request:
    req = Request(
        "r",
        prompt or [1, 2],
        SamplingParams(**kw),
        sink=lambda o: None,
        eos_token_ids=frozenset({EOS}),
    )
    req.output_ids = list(out or [])
    return req


def reference_logits(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """One row, token by token: bias and bans, then repetition / frequency / presence."""
    row = logits.clone().tolist()
    p = req.params
    for t, b in p.logit_bias:
        row[t] += b
    if len(req.output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            row[t] = -math.inf
    for t in set(req.all_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(req.output_ids):
        c = req.output_ids.count(t)
        row[t] -= p.frequency_penalty * c + p.presence_penalty
    return torch.tensor(row)


def random_greedy_case(g: torch.Generator, vocab: int) -> Request:
    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=g))]

    prompt = torch.randint(vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
    out = torch.randint(vocab, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
    bias_ids = sorted(set(torch.randint(vocab, (3,), generator=g).tolist()))
    return r(
        prompt.tolist(),
        out.tolist(),
        temperature=0,
        max_tokens=20,
        repetition_penalty=pick(1.0, 1.3, 0.7),
        frequency_penalty=pick(0.0, 0.5, -1.0),
        presence_penalty=pick(0.0, 0.8),
        min_tokens=pick(0, 5, 20),
        stop_token_ids=pick((), (3,), (4, 5)),
        logit_bias=pick((), tuple((t, 2.5) for t in bias_ids)),
        logprobs=pick(None, 0, 3),
    )


def test_greedy_matches_a_per_row_reference_with_penalties_bias_and_bans():
    g = torch.Generator().manual_seed(7)
    vocab = 40
    reqs = [random_greedy_case(g, vocab) for _ in range(64)]
    logits = torch.randn(len(reqs), vocab, generator=g) * 3
    ids, lps = sample(logits, reqs)
    for i, req in enumerate(reqs):
        ref = reference_logits(logits[i], req)
        assert ids[i] == int(ref.argmax()), i
        if req.params.logprobs is None:
            assert lps[i] is None
            continue
        raw = logits[i].log_softmax(-1)
        assert lps[i].token_id == ids[i] and lps[i].logprob == float(raw[ids[i]])
        top = raw.topk(req.params.logprobs) if req.params.logprobs else None
        assert [t for t, _ in lps[i].top] == (top.indices.tolist() if top else [])


def test_penalised_logits_match_the_reference():
    g = torch.Generator().manual_seed(3)
    reqs = [random_greedy_case(g, 30) for _ in range(16)]
    logits = torch.randn(16, 30, generator=g)
    batch = SamplingBatch.build(reqs, 30, logits.device)
    out = logits.clone()
    if batch.sparse is not None:
        out.index_put_((batch.sparse.rows, batch.sparse.tokens), batch.sparse.values, True)
    assert batch.penalties is not None
    apply_penalties(out, batch.penalties)
    for i, req in enumerate(reqs):
        torch.testing.assert_close(out[i], reference_logits(logits[i], req), rtol=1e-6, atol=1e-6)


def test_old_penalty_cases():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    assert sample(logits, [r([0, 2], temperature=0, repetition_penalty=2.0)])[0] == [1]
    cases = [(dict(presence_penalty=1.5), [1]), (dict(frequency_penalty=0.6), [1, 1])]
    for kw, out in cases:
        assert sample(torch.tensor([[2.0, 3.0, 0.0, 0.0]]), [r(out=out, temperature=0, **kw)])[
            0
        ] == [0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    req = r(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sample(logits, [req])[0] == [1]
    req.output_ids = [1, 1]
    assert sample(logits, [req])[0] == [0]
    assert sample(logits, [r(temperature=0, min_tokens=1, ignore_eos=True)])[0] == [0]


def test_an_eos_id_past_the_logits_is_not_banned_but_a_bad_bias_id_fails_its_row_alone():
    req = Request(
        "e", [1], SamplingParams(min_tokens=1), sink=lambda o: None, eos_token_ids=frozenset({99})
    )
    assert sample(torch.zeros(1, 4), [req])[0][0] in range(4)
    bad = Request("bad", [1], SamplingParams(logit_bias=((7, 1.0),)), sink=lambda o: None)
    with pytest.raises(ValueError, match="request bad: token id 7"):
        sample(torch.zeros(1, 4), [bad])
    good = r(temperature=0)
    failed: list[str] = []
    picks = sample_each(
        sample, torch.tensor([[0.0, 5.0, 0, 0]] * 2), [bad, good], lambda q, why: failed.append(why)
    )
    assert [(q.request_id, t) for q, t, _ in picks] == [("r", 1)]
    assert len(failed) == 1 and "token id 7" in failed[0]


def test_logit_bias_moves_greedy_and_draws_but_not_logprobs():
    logits = torch.tensor([[4.0, 3.0, 0.0, -2.0]])
    assert sample(logits, [r(temperature=0, logit_bias=((0, -100),))])[0] == [1]
    assert sample(logits, [r(temperature=0, logit_bias=((3, 6.5),))])[0] == [3]
    forced = r(temperature=1.0, seed=5, logit_bias=((2, 100),), logprobs=1)
    for pos in range(20):
        forced.output_ids = [1] * pos
        ids, lps = sample(logits, [forced])
        assert ids == [2]
        assert lps[0].logprob == float(logits[0].log_softmax(-1)[2])  # raw: no bias


def draws(logits_row: torch.Tensor, n: int, **kw) -> list[int]:
    """n draws of one distribution: one request per seed 0..n-1, all at position 0."""
    reqs = [r(seed=s, **kw) for s in range(n)]
    return sample(logits_row.expand(n, -1).contiguous(), reqs)[0]


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_draws_follow_the_distribution():
    # Fixed seeds: deterministic. 7 degrees of freedom: P(chi2 > 24.3) = 0.001 for a sound
    # sampler, so a failure means a biased one (or a changed stream that happens to be).
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    got = draws(probs.log(), 4000, temperature=1.0)
    assert chi_square([got.count(t) for t in range(8)], probs.tolist()) < 24.3
    # Temperature 0.5 squares the probabilities (renormalised).
    sq = probs**2 / (probs**2).sum()
    got = draws(probs.log(), 4000, temperature=0.5)
    assert chi_square([got.count(t) for t in range(8)], sq.tolist()) < 24.3


def test_draws_along_positions_follow_the_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    reqs = [r(out=[1] * pos, seed=12345, temperature=1.0, max_tokens=2000) for pos in range(1500)]
    got = sample(probs.log().expand(1500, -1).contiguous(), reqs)[0]
    assert chi_square([got.count(t) for t in range(4)], probs.tolist()) < 16.3  # 3 dof, 0.001


def test_filters_keep_their_sets_and_renormalise():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert set(draws(logits, 300, top_k=2)) == {0, 1}
    assert set(draws(logits, 300, top_p=0.8)) == {0, 1}
    assert set(draws(logits, 300, top_p=0.81)) == {0, 1, 2}
    assert set(draws(logits, 300, min_p=0.5)) == {0, 1}
    assert set(draws(logits, 100, top_p=0.01)) == {0}
    # top_p is taken over what top_k kept: 0.5 / 0.8 < 0.7 <= 0.8 / 0.8 keeps both.
    assert set(draws(logits, 300, top_k=2, top_p=0.7)) == {0, 1}
    # Ties at the k-th value all stay.
    assert set(draws(torch.tensor([1.0, 1.0, 1.0, 0.0]), 300, top_k=2)) == {0, 1, 2}
    kept = draws(logits, 3000, top_k=3)
    renorm = (probs[:3] / probs[:3].sum()).tolist()
    assert chi_square([kept.count(t) for t in range(3)], renorm) < 13.8  # 2 dof, 0.001


def test_a_rows_draw_depends_on_its_seed_and_position_only():
    g = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(8, vocab, generator=g)
    mine = r(out=[5, 6, 7], seed=42, temperature=0.9, top_p=0.95)
    alone = sample(logits[3:4], [mine])[0][0]
    others = [
        r(temperature=0),
        r(seed=1, temperature=1.0, top_k=5),
        r(seed=2, temperature=0.7, min_p=0.1, logprobs=3),
        r(out=[1, 1], seed=3, temperature=1.2, repetition_penalty=1.2, frequency_penalty=0.5),
        r(seed=4, temperature=1.0, top_p=0.5, logit_bias=((9, 3.0),)),
    ]
    for at in (0, 2, 5):
        batch = others[:at] + [mine] + others[at:]
        rows = torch.cat([logits[:at], logits[3:4], logits[at : len(others)]])
        assert sample(rows, batch)[0][at] == alone, at
    # Other output ids of the same length: the same position, the same draw.
    assert sample(logits[3:4], [r(out=[9, 9, 9], seed=42, temperature=0.9, top_p=0.95)])[0] == [
        alone
    ]
    # It really samples: other positions and seeds give other tokens.
    along = {
        sample(logits[3:4], [r(out=[0] * i, seed=42, temperature=0.9)])[0][0] for i in range(30)
    }
    assert len(along) > 5
    assert len({draws(logits[3], 30, temperature=0.9)[i] for i in range(30)}) > 5


def test_tiny_temperature_is_greedy_and_top_k_past_the_vocab_keeps_everything():
    logits = torch.tensor([[0.1, 3.0, 2.9, 0.0], [1.0, 0.0, 0.0, 0.5]])
    ids, _ = sample(logits, [r(temperature=1e-40), r(temperature=1e-6, seed=1)])
    assert ids == [1, 0]
    assert set(draws(torch.zeros(4), 200, top_k=2**31 - 1)) == {0, 1, 2, 3}


def test_seeds_at_the_edges_of_the_accepted_range_sample():
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        assert 0 <= sample(torch.zeros(1, 8), [r(temperature=1.0, seed=seed)])[0][0] < 8


def test_logprobs_are_raw_and_each_row_gets_its_own_count():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 1.0], [1.0, 1.0, 1.0, 9.0]])
    reqs = [r(temperature=0, logprobs=2), r(temperature=0), r(temperature=0.5, logprobs=0)]
    ids, lps = sample(logits, reqs)
    ref = logits.log_softmax(-1)
    assert ids[:2] == [2, 2] and lps[1] is None
    assert math.isclose(lps[0].logprob, float(ref[0, 2]), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [2, 1] and lps[2].top == ()
    assert lps[2].token_id == ids[2] and lps[2].logprob == float(ref[2, ids[2]])


def test_an_unseeded_request_gets_its_own_seed():
    a, b = r(temperature=1.0), r(temperature=1.0)
    assert a.seed != b.seed and r(seed=3).seed == 3


def test_an_empty_batch():
    assert sample(torch.zeros(0, 4), []) == ([], [])


def test_16_bit_logits_sample_what_their_float32_copy_samples():
    """The model hands the sampler its own dtype; every path (greedy, bias and bans, penalties,
    draws through the filters, logprobs) widens to float32 where it needs to, so a bf16 batch
    picks and scores exactly as its float32 copy does."""
    g = torch.Generator().manual_seed(11)
    vocab = 50
    reqs = [random_greedy_case(g, vocab) for _ in range(24)]
    for i, kw in enumerate(
        [
            dict(temperature=0.8, seed=5),
            dict(temperature=1.2, top_k=7, seed=6, logprobs=2),
            dict(temperature=0.7, top_p=0.6, min_p=0.05, seed=7, presence_penalty=0.5),
        ]
    ):
        req = r([1, 2, 3], [4, 4], max_tokens=20, **kw)
        req.request_id = f"draw{i}"
        reqs.append(req)
    logits = (torch.randn(len(reqs), vocab, generator=g) * 4).to(torch.bfloat16)
    want = sample(logits.float(), reqs)
    got = sample(logits, reqs)
    assert got == want
