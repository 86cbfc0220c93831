"""DeepSeek-V3 (latent attention + experts): greedy ids equal HF transformers' generate in
float32 on `deepseek-v3-tiny`, through pdserve's engine, alone and 16 at once, with prompts at
page and prefill-chunk boundaries, chunked prefill and a prefix-cache hit; and PD (a prefill
role writing latent pages into a decode role's pool) equals co-located."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.layout import KVLayout
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import hf_greedy, split_counter
from tests.worker.wire import Wire, ended, tokens

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
PAGE, CHUNK = 4, 12
# Around the page (4) and chunk (12) boundaries; 16 prompts for the concurrent run.
LENGTHS = [1, 3, 4, 5, 7, 11, 12, 13, 16, 23, 24, 25, 30, 36, 37, 41]


@pytest.fixture(scope="module")
def ds_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v3-tiny")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(16)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_ref(ds_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    assert json.loads((ds_dir / "config.json").read_text())["architectures"] == [
        "DeepseekV3ForCausalLM"
    ]
    return hf_greedy(ds_dir, prompts, NEW_TOKENS)


# Where the Triton paths run: compiled on a GPU, in Triton's interpreter on a CPU-only machine.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def engine(path: Path, **kw: object):  # type: ignore[no-untyped-def]
    args: dict = dict(page_size=PAGE, max_batched_tokens=CHUNK, kv_budget_mb=4.0)
    return build_engine(path, max_model_len=512, **{**args, **kw})


def test_the_pool_holds_one_latent_buffer_per_layer(ds_dir: Path) -> None:
    e = engine(ds_dir)
    assert e.pool.layout == KVLayout.mla("float32", PAGE, 3, kv_lora_rank=32, qk_rope_head_dim=16)
    assert e.runner.backend.name == "torch"


def test_the_triton_backend_decodes_absorbed_and_matches_hf(ds_dir, prompts, hf_ref) -> None:
    """Asked for, `triton` serves latent attention (attention/mla_backend.py: its decode steps
    in MLA's absorbed form; on the CPU in Triton's interpreter); HF's ids, alone and 3 at once."""
    e = engine(
        ds_dir,
        attention_backend="triton",
        prefix_cache=False,
        device=TRITON_DEVICE,
        enforce_eager=True,
    )
    assert e.runner.backend.name == "triton" and e.runner.graphs is None
    picked = [LENGTHS.index(n) for n in (5, 13, 37)]
    batch = [prompts[i] for i in picked]
    assert [generate(e, [p], GREEDY)[0] for p in batch] == [hf_ref[i] for i in picked]
    assert generate(e, batch, GREEDY) == [hf_ref[i] for i in picked]


def test_mixed_steps_on_the_triton_backend_match_hf(ds_dir, prompts, hf_ref) -> None:
    """Four prompts at most 6 tokens a step: later prompts' chunks share steps with earlier
    ones' decodes, which attend absorbed while only the chunks' sequences are gathered and
    expanded (`split`); HF's ids."""
    e = engine(
        ds_dir,
        attention_backend="triton",
        prefix_cache=False,
        device=TRITON_DEVICE,
        enforce_eager=True,
        max_batched_tokens=6,
    )
    mixed = split_counter(e.runner.backend)
    picked = [LENGTHS.index(n) for n in (3, 13, 25, 37)]
    assert generate(e, [prompts[i] for i in picked], GREEDY) == [hf_ref[i] for i in picked]
    assert mixed  # steps of decodes beside the next prompt's chunks, split


def test_greedy_matches_hf_alone_and_16_at_once(ds_dir, prompts, hf_ref) -> None:
    e = engine(ds_dir, prefix_cache=False)
    alone = [generate(e, [p], GREEDY)[0] for p in prompts]
    wrong = [(n, a, r) for n, a, r in zip(LENGTHS, alone, hf_ref, strict=True) if a != r]
    assert not wrong, f"prompt length, ours, HF: {wrong[:2]}"
    assert generate(e, prompts, GREEDY) == hf_ref
    assert e.pool.allocator.num_held == 0


def test_a_prefix_cache_hit_gives_the_same_tokens(ds_dir, prompts, hf_ref) -> None:
    """The second run of a prompt starts from its cached latent pages (chunked: 37 tokens in
    chunks of 12) and computes only the rest."""
    e = engine(ds_dir, prefix_cache=True)
    i = LENGTHS.index(37)
    first = generate(e, [prompts[i]], GREEDY)[0]
    assert e.prefix_cache is not None and e.prefix_cache.stats.hits == 0
    second = generate(e, [prompts[i]], GREEDY)[0]
    assert e.prefix_cache.stats.hits == 1 and e.prefix_cache.stats.hit_tokens >= 32
    assert first == second == hf_ref[i]


def test_pd_equals_colocated(ds_dir, prompts, hf_ref) -> None:
    """A prefill role computes the prompt and writes its latent pages into the decode role's
    pool over shm; the decode role continues from them."""
    wire = Wire(ds_dir, page_size=PAGE, chunk=CHUNK)
    picked = [LENGTHS.index(n) for n in (5, 24, 41)]
    outs = [wire.submit(f"r{i}", prompts[i], GREEDY) for i in picked]
    wire.run_until(lambda: all(ended(o) for o in outs))
    assert [tokens(o) for o in outs] == [hf_ref[i] for i in picked]
    wire.run_until(wire.idle)
    assert wire.violations() == []


def test_rope_without_interleave_or_yarn_matches_hf(ds_dir, prompts, hf_ref, tmp_path) -> None:
    """The other rope layout (halves, not pairs) and plain rope, on the same weights."""
    path = tmp_path / "halves"
    shutil.copytree(ds_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(rope_interleave=False, rope_scaling=None)
    (path / "config.json").write_text(json.dumps(cfg))
    picked = [prompts[LENGTHS.index(n)] for n in (5, 13, 25)]
    ref = hf_greedy(path, picked, NEW_TOKENS)
    assert generate(engine(path), picked, GREEDY) == ref
    assert ref != [hf_ref[LENGTHS.index(n)] for n in (5, 13, 25)]  # the rope change mattered


def test_the_fused_experts_keep_greedy_parity(ds_dir, prompts, hf_ref, monkeypatch) -> None:
    """The routed experts through the Triton grouped GEMMs (kernels/triton_moe.py; on the CPU
    in Triton's interpreter, forced by $PDSERVE_FUSED_MOE) give HF's ids in float32."""
    from pdserve.kernels import ops

    pytest.importorskip("triton")
    monkeypatch.setenv(ops.FUSED_MOE_ENV, "1")
    if not torch.cuda.is_available():
        from pdserve.attention.triton_common import interpreted
        from pdserve.kernels import triton_moe

        if not interpreted(triton_moe._gate_up_kernel):
            pytest.skip("Triton kernels imported compiled without a GPU")
    calls = []
    fused = ops.fused_moe
    monkeypatch.setattr(ops, "fused_moe", lambda *a: calls.append(1) or fused(*a))
    picked = [LENGTHS.index(n) for n in (5, 13)]
    assert generate(engine(ds_dir, device=TRITON_DEVICE), [prompts[i] for i in picked], GREEDY) == [
        hf_ref[i] for i in picked
    ]
    assert calls  # the fused path ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_greedy_matches_hf_on_the_gpu(ds_dir, prompts, hf_ref) -> None:
    """float32 on the GPU: the device's default backend, triton (decode steps absorbed, by
    the Triton kernel, replayed as CUDA graphs: the experts fused), and eagerly; HF's ids (HF
    on the CPU)."""
    for eager in (False, True):
        e = build_engine(
            ds_dir,
            device="cuda",
            page_size=PAGE,
            max_batched_tokens=CHUNK,
            max_model_len=512,
            enforce_eager=eager,
        )
        assert e.runner.backend.name == "triton"
        assert generate(e, prompts, GREEDY) == hf_ref, f"enforce_eager={eager}"
        assert e.pool.allocator.num_held == 0
        if eager:
            assert e.runner.graphs is None
        else:
            assert e.runner.graphs is not None and e.runner.graphs.replays > 0
