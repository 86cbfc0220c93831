"""DeepSeek-V4 against HF transformers in float32 on `deepseek-v4-tiny`, through plain-tensor KV
(`LocalStepKV`, state starting as NaN): greedy ids equal HF's `generate` (eager, one-shot
prefill then decode) for prompts crossing the 16-token window, CSA's 4-token and HCA's
128-token windows, whatever our chunks of prefill (token by token, 7, 64, 130, mixed, one
shot) before decoding token by token; the logits agree to float rounding; a step mixing
sequences (different starts, a decode beside prefill chunks) equals each sequence alone, in
its outputs and in the KV it leaves."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.attention.backend import AttentionContext
from pdserve.kvcache.v4_layout import v4_buffers, v4_state
from pdserve.model.deepseek_v4.kv import LocalSeqKV, LocalStepKV, Span
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16
LENGTHS = [5, 77, 131, 258, 301, 517]
# (prompt length, our prefill chunks, cycled). Chunks of 1, 7 and 130 end inside CSA's
# 4-token windows; 1 and 7 are shorter than the 16-token sliding window, so its keys come from
# the ring of earlier steps; 64 ends chunks exactly where HCA's 128-token windows close, 130
# two tokens past; the mixed schedules put chunk boundaries everywhere else.
SCHEDULES = [
    (5, [1]),
    (5, [5]),
    (77, [7]),
    (131, [64]),
    (131, [1]),
    (258, [130]),
    (258, [64, 1, 7]),
    (258, [1]),  # token by token across both HCA windows
    (301, [7, 130, 1, 64]),
    (517, [517]),
    (517, [130, 7]),
]
LOGIT_TOL = 1e-3  # logits are ~70 in size; float32 rounding leaves ~5e-5


@pytest.fixture(scope="module")
def v4_dir(builtin_dir: Any) -> Path:
    return Path(builtin_dir("deepseek-v4-tiny"))


@pytest.fixture(scope="module")
def model(v4_dir: Path) -> DeepseekV4ForCausalLM:
    m = load_model(v4_dir, torch.float32, torch.device("cpu"))
    assert isinstance(m, DeepseekV4ForCausalLM)
    return m


@pytest.fixture(scope="module")
def prompts() -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(4)
    return {n: torch.randint(3, 4000, (n,), generator=g).tolist() for n in LENGTHS}


@pytest.fixture(scope="module")
def hf_ref(v4_dir: Path, prompts: dict[int, list[int]]) -> dict[int, tuple[list[int], Any]]:
    """HF's greedy ids and per-step logits [NEW_TOKENS, vocab] for each prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV4ForCausalLM"
    assert hf.config._attn_implementation == "eager"
    out = {}
    with torch.no_grad():
        for n, p in prompts.items():
            x = torch.tensor([p])
            r = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            out[n] = (r.sequences[0, n:].tolist(), torch.cat(r.logits))
    return out


def fresh_kv(model: DeepseekV4ForCausalLM) -> LocalSeqKV:
    v4 = model.v4
    buffers = {b.name: b for b in v4_buffers(v4, "float32", 128)}
    return LocalSeqKV(buffers, {s.name: s for s in v4_state(v4, "float32")})


def step(
    model: DeepseekV4ForCausalLM, seqs: list[tuple[LocalSeqKV, list[int], int]]
) -> torch.Tensor:
    """One forward over sequences (kv, new token ids, start): the hidden states [T, hidden]."""
    spans, ids, positions, first = [], [], [], 0
    for _, tokens, start in seqs:
        spans.append(Span(first, len(tokens), start))
        ids += tokens
        positions += range(start, start + len(tokens))
        first += len(tokens)
    kv = LocalStepKV([s for s, _, _ in seqs], spans)
    with torch.no_grad():
        return model.forward_kv(torch.tensor(ids), torch.tensor(positions), kv)


def greedy(
    model: DeepseekV4ForCausalLM, prompt: list[int], chunks: list[int], new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Prefill in `chunks` (cycled), then decode one token per step: (ids, logits)."""
    kv, at, sizes = fresh_kv(model), 0, itertools.cycle(chunks)
    while at < len(prompt):
        n = min(next(sizes), len(prompt) - at)
        hidden = step(model, [(kv, prompt[at : at + n], at)])
        at += n
    ids: list[int] = []
    logits = []
    while True:
        assert torch.isfinite(hidden).all()
        row = model.compute_logits(hidden[-1:])[0]
        logits.append(row)
        ids.append(int(row.argmax()))
        if len(ids) == new_tokens:
            return ids, torch.stack(logits)
        hidden = step(model, [(kv, ids[-1:], len(prompt) + len(ids) - 1)])


@pytest.mark.parametrize(
    ("length", "chunks"), SCHEDULES, ids=[f"{n}-by-{'-'.join(map(str, c))}" for n, c in SCHEDULES]
)
def test_greedy_matches_hf_whatever_the_prefill_chunks(
    model: DeepseekV4ForCausalLM,
    prompts: dict[int, list[int]],
    hf_ref: dict[int, tuple[list[int], torch.Tensor]],
    length: int,
    chunks: list[int],
) -> None:
    want, want_logits = hf_ref[length]
    got, logits = greedy(model, prompts[length], chunks, NEW_TOKENS)
    assert got == want
    assert (logits - want_logits).abs().max().item() < LOGIT_TOL


def test_the_tiny_model_is_peaked_and_its_choices_vary(
    hf_ref: dict[int, tuple[list[int], torch.Tensor]],
) -> None:
    """Float rounding cannot flip HF's greedy choice (top-2 gaps far above it), and the
    output depends on the prompt."""
    top2 = torch.cat([logits.topk(2, dim=-1).values for _, logits in hf_ref.values()])
    gaps = (top2[:, 0] - top2[:, 1]).sort().values
    assert gaps[0] > 1e-3 and gaps[len(gaps) // 2] > 1.0, gaps[:5]
    assert len({tuple(ids) for ids, _ in hf_ref.values()}) == len(hf_ref)


def _prefilled(model: DeepseekV4ForCausalLM, prompt: list[int], upto: int) -> LocalSeqKV:
    kv = fresh_kv(model)
    if upto:
        step(model, [(kv, prompt[:upto], 0)])
    return kv


def test_a_mixed_step_equals_each_sequence_alone(
    model: DeepseekV4ForCausalLM, prompts: dict[int, list[int]]
) -> None:
    """Four sequences in one step: a 51-token chunk from 250 (across HCA's 256 and the
    window), a decode at 131, a fresh 77-token prefill, 2 tokens at 3: outputs and the KV
    left behind equal running each alone."""
    p301, p131, p77, p5 = (prompts[n] for n in (301, 131, 77, 5))
    cases = [
        (_prefilled(model, p301, 250), p301[250:301], 250),
        (_prefilled(model, p131, 131), [p301[7]], 131),
        (fresh_kv(model), p77, 0),
        (_prefilled(model, p5, 3), p5[3:5], 3),
    ]
    alone_kv = [copy.deepcopy(kv) for kv, _, _ in cases]
    together = step(model, cases)
    at = 0
    for (kv, tokens, start), own in zip(cases, alone_kv, strict=True):
        alone = step(model, [(own, tokens, start)])
        torch.testing.assert_close(together[at : at + len(tokens)], alone, atol=1e-5, rtol=0)
        at += len(tokens)
        assert kv.entries.keys() == own.entries.keys() and kv.slots.keys() == own.slots.keys()
        for key in kv.entries:
            torch.testing.assert_close(kv.entries[key], own.entries[key], atol=1e-5, rtol=0)
        for key in kv.slots:  # rows never written stay NaN in both
            torch.testing.assert_close(
                kv.slots[key], own.slots[key], atol=1e-5, rtol=0, equal_nan=True
            )


def test_the_kv_holds_what_the_layout_says(
    model: DeepseekV4ForCausalLM, prompts: dict[int, list[int]]
) -> None:
    """After 301 tokens: 75 CSA entries and index keys, 2 HCA entries per layer; the tails
    hold 301 % 4 and 301 % 128 rows, the rest of each tail slot was never written; each of
    the 2 whole pages of 128 tokens kept its end's ring (every layer) and CSA's overlap."""
    kv = _prefilled(model, prompts[301], 301)
    v4 = model.v4
    for layer, kind in enumerate(v4.layer_types):
        ratio = v4.ratio(layer)
        assert kv.entries[(layer, "swa.page_ring")].shape == (2, v4.sliding_window, v4.head_dim)
        if ratio is None:
            assert {key[1] for key in kv.entries if key[0] == layer} == {"swa.page_ring"}
            continue
        if ratio == v4.csa_ratio:
            for name in ("csa.page_overlap_kv", "csa.page_index_overlap_gate"):
                assert kv.entries[(layer, name)].shape[0] == 2
        names = ("csa.kv", "csa.index_k") if ratio == v4.csa_ratio else ("hca.kv",)
        for name in names:
            assert kv.entries[(layer, name)].shape[0] == 301 // ratio, (layer, kind, name)
        tail = kv.slots[(layer, "csa.tail_kv" if ratio == v4.csa_ratio else "hca.tail_kv")]
        assert torch.isfinite(tail[: 301 % ratio]).all()
        assert torch.isnan(tail[301 % ratio :]).all()
        assert torch.isfinite(kv.slots[(layer, "swa.ring")]).all()


class _Backend:
    """A V4KVBackend whose metadata is the step's KV itself."""

    name = "torch"

    def step_kv(self, metadata: Any) -> Any:
        return metadata


def test_forward_takes_the_kv_from_the_backend(
    model: DeepseekV4ForCausalLM, prompts: dict[int, list[int]]
) -> None:
    ids = prompts[77][:20]
    want = step(model, [(fresh_kv(model), ids, 0)])
    kv = LocalStepKV([fresh_kv(model)], [Span(0, 20, 0)])
    with torch.no_grad():
        got = model(torch.tensor(ids), torch.arange(20), AttentionContext(_Backend(), kv))
    assert torch.equal(got, want)
    plain = AttentionContext(SimpleNamespace(name="triton"), kv)
    with pytest.raises(ValueError, match="backend 'triton' cannot serve DeepSeek-V4"):
        model(torch.tensor(ids), torch.arange(20), plain)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spans", "named"),
    [
        (
            [Span(0, 10, 0), Span(12, 8, 0)],
            r"span 1 .* does not continue the step's tokens at row 10",
        ),
        ([Span(0, 0, 0), Span(0, 20, 0)], r"span 0 .* does not continue"),
        ([Span(0, 10, 0)], "the spans cover 10 tokens, the step has 20"),
    ],
)
def test_spans_must_tile_the_step(
    model: DeepseekV4ForCausalLM, spans: list[Span], named: str
) -> None:
    kv = LocalStepKV([fresh_kv(model) for _ in spans], spans)
    with pytest.raises(ValueError, match=named):
        model.forward_kv(torch.zeros(20, dtype=torch.long), torch.arange(20), kv)
