"""DeepSeek-V3.2 (V3 + the lightning indexer): greedy ids equal HF transformers' generate in
float32 on `deepseek-v32-tiny` (index_topk 12, so every prompt past 12 tokens attends
sparsely), alone and 16 at once, with prompts at page (4) and chunk (12) boundaries; the fp8
index-K mode equals its float32 torch reference through the whole model (HF's model with its
indexer swapped for that reference); and how often fp8 changes a bf16 model's choices is
reported, not asserted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.layout import BufferSpec, KVLayout
from pdserve.model import deepseek_v32
from pdserve.model.config import ModelArch
from pdserve.model.dsa_indexer import (
    IndexKMode,
    dequantize_index_k,
    hadamard_rotate,
    index_k_for_cache,
    quantize_fp8,
    select,
)
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import split_counter

transformers = pytest.importorskip("transformers")
hf_v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")

NEW_TOKENS = 4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
PAGE, CHUNK, TOPK = 4, 12, 12
# Page and chunk boundaries, index_topk and past it, a 40-token prompt. The 16 concurrent
# requests are these 8 prompts twice (prefix cache off: each computes its own), so that HF
# runs 8 generates, not 16.
LENGTHS = [1, 4, 5, 12, 13, 24, 25, 40]
ALONE = [13, 40]


@pytest.fixture(scope="module")
def ds_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v32-tiny")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(32)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in LENGTHS]


def hf_generate(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def hf_model(ds_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV32ForCausalLM"
    return model.eval()


@pytest.fixture(scope="module")
def hf_ref(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    return hf_generate(hf_model, prompts)


def engine(path: Path, **kw: Any):  # type: ignore[no-untyped-def]
    args: dict[str, Any] = dict(page_size=PAGE, max_batched_tokens=CHUNK, kv_budget_mb=4.0)
    return build_engine(path, max_model_len=512, prefix_cache=False, **{**args, **kw})


def test_the_pool_holds_latent_and_index_k_in_either_mode(ds_dir: Path) -> None:
    arch = ModelArch.from_dir(ds_dir)
    assert arch.dsa is not None and arch.dsa.index_topk == TOPK and arch.mla is not None
    assert arch.mla.rope_interleave
    latent = BufferSpec("latent", (1, 48), "float32")
    auto = KVLayout.for_model(arch, "float32", PAGE)
    assert auto.buffers == (latent, BufferSpec("index_k", (32,), "float32"))
    fp8 = KVLayout.for_model(arch, "float32", PAGE, "fp8")
    assert fp8.buffers == (
        latent,
        BufferSpec("index_k", (32,), "float8_e4m3fn"),
        BufferSpec("index_k_scale", (1,), "float32"),
    )
    assert auto.mismatch(fp8) == "buffer 'index_k' dtype: 'float32' vs 'float8_e4m3fn'"
    with pytest.raises(ValueError, match="index-K dtype must be 'auto' or 'fp8'"):
        KVLayout.for_model(arch, "float32", PAGE, "int8")
    e = engine(ds_dir, index_k_dtype="fp8")
    assert e.pool.layout == fp8 and e.runner.backend.name == "torch"


# Where the Triton paths run: compiled on a GPU, in Triton's interpreter on a CPU-only machine.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_triton_backend_decodes_over_the_picks_and_matches_hf(ds_dir, prompts, hf_ref):
    """Asked for, `triton` serves V3.2 (attention/mla_backend.py): its decode steps score the
    paged index-K and pick on the device (attention/triton_index_scores.py) and attend
    absorbed over the picked latents only; HF's ids, alone and together (prompts past
    index_topk included; on the CPU in Triton's interpreter, eagerly)."""
    e = engine(ds_dir, attention_backend="triton", device=TRITON_DEVICE, enforce_eager=True)
    assert e.runner.backend.name == "triton"
    picked = [LENGTHS.index(n) for n in (5, 13, 40)]
    batch = [prompts[i] for i in picked]
    assert [generate(e, [p], GREEDY)[0] for p in batch] == [hf_ref[i] for i in picked]
    assert generate(e, batch, GREEDY) == [hf_ref[i] for i in picked]
    assert e.pool.allocator.num_held == 0


def test_fp8_index_k_on_the_triton_backend_equals_the_torch_backend(ds_dir, prompts) -> None:
    """fp8 index-K: the decode-step kernels (the fp8 score form, scales per key) pick what the
    torch backend's indexer picks, so the tokens are the same (prompts past index_topk)."""
    batch = [prompts[LENGTHS.index(n)] for n in (13, 25, 40)]
    want = generate(engine(ds_dir, index_k_dtype="fp8"), batch, GREEDY)
    e = engine(
        ds_dir, index_k_dtype="fp8", attention_backend="triton", device=TRITON_DEVICE,
        enforce_eager=True,
    )  # fmt: skip
    assert generate(e, batch, GREEDY) == want


def test_mixed_steps_on_the_triton_backend_match_hf(ds_dir, prompts, hf_ref) -> None:
    """Four prompts (past index_topk) at most 6 tokens a step: later prompts' chunks share
    steps with earlier ones' decodes, whose indexer scores and picks over their own sequences
    only and which attend absorbed, while the chunks are gathered and expanded (`split`)."""
    e = engine(
        ds_dir,
        attention_backend="triton",
        device=TRITON_DEVICE,
        enforce_eager=True,
        max_batched_tokens=6,
    )
    mixed = split_counter(e.runner.backend)
    picked = [LENGTHS.index(n) for n in (5, 13, 25, 40)]
    assert generate(e, [prompts[i] for i in picked], GREEDY) == [hf_ref[i] for i in picked]
    assert mixed  # steps of decodes beside the next prompt's chunks, split


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_greedy_matches_hf_on_the_gpu_through_cuda_graphs(ds_dir, prompts, hf_ref) -> None:
    """float32 on the GPU: the default backend (triton), decode steps replayed as CUDA
    graphs (the experts fused), and eagerly; HF's ids for every prompt, 16 at once."""
    for eager in (False, True):
        e = engine(ds_dir, device="cuda", enforce_eager=eager)
        assert e.runner.backend.name == "triton"
        assert generate(e, prompts + prompts[::-1], GREEDY) == hf_ref + hf_ref[::-1]
        assert (e.runner.graphs is None) == eager
        assert eager or e.runner.graphs.replays > 0
        assert e.pool.allocator.num_held == 0


def test_greedy_matches_hf_alone_and_16_at_once(ds_dir, prompts, hf_ref) -> None:
    e = engine(ds_dir)
    for n in ALONE:
        i = LENGTHS.index(n)
        assert generate(e, [prompts[i]], GREEDY)[0] == hf_ref[i], f"prompt of {n}"
    together = generate(e, prompts + prompts[::-1], GREEDY)
    want = hf_ref + hf_ref[::-1]
    wrong = [(len(p), a, r) for p, a, r in zip(prompts, together, want, strict=False) if a != r]
    assert together == want, f"prompt length, ours, HF: {wrong[:2]}"
    assert e.pool.allocator.num_held == 0


def _fp8_reference_indexer(
    self: Any,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    pe: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    position_ids: Any,
    cache: Any = None,
    past_key_values: Any = None,
) -> torch.Tensor:
    """HF's indexer with fp8 index-K: its own keys and queries, each key stored as fp8 with
    its per-token scale, scores in plain float32 on the dequantised values (the formula of
    HF's float path), our tie rule. Batch 1. (transformers 5.17 passes the cache as
    `past_key_values`, 5.24 as `cache`.)"""
    cache = cache if cache is not None else past_key_values
    cos, sin = pe
    rope, n, d = self.qk_rope_head_dim, self.n_heads, self.head_dim
    q = self.wq_b(q_resid).view(*hidden.shape[:2], n, d)
    k = self.k_norm(self.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = hf_v32.apply_rotary_pos_emb(
        q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2
    )
    q = torch.cat((q_rot, q[..., rope:]), -1)[0]  # [S, H, D]
    k = torch.cat((k_rot, k[..., rope:]), -1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    stored = index_k_for_cache(k[0], IndexKMode.FP8)  # [T, D] fp8 and [T, 1]
    k_deq = dequantize_index_k(stored["index_k"], stored["index_k_scale"])
    q8, q_scale = quantize_fp8(hadamard_rotate(q))
    q_deq = q8.float() * q_scale[..., None]
    logits = torch.relu(torch.einsum("shd,td->sht", q_deq, k_deq) * self.softmax_scale)
    w = self.weights_proj(hidden.float())[0].float() * n**-0.5  # [S, H]
    scores = torch.einsum("sh,sht->st", w, logits)
    causal = mask[0] if mask.dtype == torch.bool else mask[0] == 0
    chosen = select(scores, causal, self.index_topk)
    # HF scatters indices: the chosen ones, then (while the context is short) non-causal ones
    # that its causal mask hides anyway.
    order = torch.sort((~chosen).int(), dim=-1, stable=True).indices
    return order[None, :, : min(self.index_topk, scores.shape[-1])].int()


def test_fp8_index_k_matches_its_torch_reference_through_the_model(
    ds_dir, prompts, hf_model, hf_ref, monkeypatch
) -> None:
    """Our fp8 mode end to end (quantised keys in the pool, fp8 scoring) against HF's model
    whose indexer is the plain float32 reference on the same fp8 values: the same selections
    give the same logits, so the greedy ids agree token for token."""
    picked = [LENGTHS.index(n) for n in (24, 25)]
    ours = generate(engine(ds_dir, index_k_dtype="fp8"), [prompts[i] for i in picked], GREEDY)
    assert ours != [hf_ref[i] for i in picked]  # fp8 changed choices: the check has teeth
    monkeypatch.setattr(hf_v32.DeepseekV32Indexer, "forward", _fp8_reference_indexer)
    assert ours == hf_generate(hf_model, [prompts[i] for i in picked])


def _prefill_selections(e: Any, prompts: list[list[int]], monkeypatch: Any) -> list[torch.Tensor]:
    """Every layer's [Q, L] choice for each prompt's prefill (one chunk each)."""
    seen: list[torch.Tensor] = []
    real = deepseek_v32.SparseMLAttention.visible

    def spy(self: Any, *args: Any) -> torch.Tensor:
        mask = real(self, *args)
        seen.extend(mask)
        return mask

    with monkeypatch.context() as m:
        m.setattr(deepseek_v32.SparseMLAttention, "visible", spy)
        for p in prompts:
            generate(e, [p], SamplingParams(max_tokens=1, temperature=0))
    return seen


def test_report_fp8_against_bf16_selections_through_the_model(ds_dir, monkeypatch) -> None:
    """Reported, not asserted equal: a bf16 model's prefill choices, bf16 vs fp8 index-K."""
    g = torch.Generator().manual_seed(7)
    long = [torch.randint(3, 4000, (40,), generator=g).tolist()]
    runs = [
        _prefill_selections(
            engine(ds_dir, dtype="bfloat16", max_batched_tokens=64, index_k_dtype=mode),
            long,
            monkeypatch,
        )
        for mode in ("auto", "fp8")
    ]
    rows = differ = swapped = 0
    for a, b in zip(*runs, strict=True):  # one [Q, L] per (prompt, layer)
        causal = torch.arange(a.shape[1])[None, :] <= torch.arange(a.shape[0])[:, None]
        for m in (a, b):  # both are valid choices: min(k, context) causal keys per token
            assert not (m & ~causal).any()
            assert torch.equal(m.sum(1), causal.sum(1).clamp(max=TOPK))
        sparse = causal.sum(1) > TOPK
        diff = (a != b)[sparse]
        rows, differ = rows + int(sparse.sum()), differ + int(diff.any(1).sum())
        swapped += int(diff.sum()) // 2
    assert rows == 3 * (40 - TOPK)  # 3 layers
    print(
        f"\nbf16 model, fp8 vs bf16 index-K: {differ}/{rows} sparse rows choose differently; "
        f"{swapped}/{rows * TOPK} chosen keys swapped"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_greedy_matches_hf_on_the_gpu_and_fp8_agrees_with_the_cpu(ds_dir, prompts, hf_ref) -> None:
    """float32 on the GPU on the torch backend (eager): HF's ids (HF on the CPU); the fp8 mode's
    ids equal the fp8 mode's on the CPU, on the torch backend and on the triton one (the
    decode-step score kernel's fp8 form, through CUDA graphs)."""
    e = engine(ds_dir, device="cuda", attention_backend="torch")
    assert e.runner.backend.name == "torch" and e.runner.graphs is None
    assert generate(e, prompts, GREEDY) == hf_ref
    runs = (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton"))
    fp8 = [
        generate(
            engine(ds_dir, device=d, index_k_dtype="fp8", attention_backend=b), prompts, GREEDY
        )
        for d, b in runs
    ]
    assert fp8[0] == fp8[1] == fp8[2]
