"""MLA's absorbed decode: the Triton kernel (attention/triton_mla_decode.py) equals the pure-torch
reference (`latent_decode_torch`), and both, with kv_b_proj's value half applied, equal the
expanded form (every cached latent through kv_b_proj, each head's whole query and key) in
float64; through a whole model, the `triton` backend of a latent pool (attention/mla_backend.py)
decodes absorbed and equals the `torch` backend's expanded form.

Runs in Triton's CPU interpreter without a GPU (test_triton_kernels.py sets it up) at small
shapes (4 heads, kv_lora 32, rope 16, pages of 4, lengths 1..37); compiled on a GPU at
DeepSeek-V3's (128 heads, 512 + 64, contexts past 4,096). Every case: pages scattered in a pool
of two layers (a layer's view strided across pages), a padded row (kv_len 0), one split and
several, some of them past a short row's end (empty).
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports the kernels (see the kernel tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from pdserve.attention.backend import AttentionContext, LatentDecodeBackend  # noqa: E402
from pdserve.attention.batch import BatchBuilder, SeqSpan  # noqa: E402
from pdserve.attention.mla_backend import (  # noqa: E402
    LatentKernel,
    MLABackend,
    latent_decode_torch,
)
from pdserve.attention.registry import make_backend  # noqa: E402
from pdserve.attention.torch_backend import TorchBackend  # noqa: E402
from pdserve.attention.triton_decode import partial_shapes  # noqa: E402
from pdserve.attention.triton_mla_decode import paged_latent_decode  # noqa: E402
from pdserve.kvcache.layout import LATENT, KVLayout  # noqa: E402
from pdserve.kvcache.pool import KVPool  # noqa: E402
from pdserve.model.loader import load_model  # noqa: E402
from pdserve.model.mla_absorbed import absorb_query, expand_output  # noqa: E402
from tests.attention.test_triton_kernels import DEVICE, GPU  # noqa: E402

HEADS, RANK, ROPE, NOPE, V = (128, 512, 64, 128, 128) if GPU else (4, 32, 16, 24, 20)
PS = 16 if GPU else 4
LENGTHS = (1, 63, 64, 65, 1000, 4097) if GPU else (1, 5, 37)
SPLITS = (1, 3, 16) if GPU else (1, 3)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Case:
    """A pool of two layers of random latents; rows on scattered pages, then a padded row."""

    def __init__(self, dtype: torch.dtype, lengths: tuple[int, ...], seed: int = 0) -> None:
        self.dtype = dtype
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        rng = random.Random(seed)
        need = [-(-n // PS) for n in lengths]
        num_pages = 2 * sum(need) + 8
        layout = KVLayout.mla(str(dtype).removeprefix("torch."), PS, 2, RANK, ROPE)
        self.pool = KVPool(layout, num_pages, DEVICE)
        for i in range(2):
            view = self.pool.view(i, LATENT)
            view.copy_(self.randn(*view.shape))
        free = list(range(1, num_pages))
        rng.shuffle(free)
        table = torch.zeros(len(lengths) + 1, max(need), dtype=torch.int32)
        for r, n in enumerate(need):
            table[r, :n] = torch.tensor([free.pop() for _ in range(n)])
        self.page_table = table.to(DEVICE)
        self.kv_lens = torch.tensor([*lengths, 0], dtype=torch.int32, device=DEVICE)
        self.cache = self.pool.view(1, LATENT)
        rows = len(lengths) + 1
        self.q_nope = self.randn(rows, HEADS, NOPE)
        self.q_rope = self.randn(rows, HEADS, ROPE)
        self.w_uk = self.randn(HEADS, NOPE, RANK) / RANK**0.5
        self.w_uv = self.randn(HEADS, V, RANK) / RANK**0.5
        self.scale = (NOPE + ROPE) ** -0.5 * 1.3  # a YaRN-like mscale on top

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=DEVICE).to(self.dtype)

    def kernel(self, q_latent: torch.Tensor, splits: int) -> torch.Tensor:
        out = torch.full_like(q_latent, float("nan"))
        part_out = part_lse = None
        if splits > 1:
            shapes = partial_shapes(q_latent.shape[0], HEADS, splits, RANK)
            part_out = torch.full(shapes[0], float("nan"), device=DEVICE)
            part_lse = torch.full(shapes[1], float("nan"), device=DEVICE)
        paged_latent_decode(
            q_latent,
            self.q_rope,
            self.cache,
            self.page_table,
            self.kv_lens,
            out,
            self.scale,
            splits,
            part_out,
            part_lse,
            block_n=16 if not GPU else 32,
        )
        return out

    def expanded(self) -> torch.Tensor:  # [rows, H, V] float64
        """HF's form: each row's latents through W_UK and W_UV, keys [k_nope | k_rope]."""
        outs = []
        w_uk, w_uv = self.w_uk.double(), self.w_uv.double()
        for r, n in enumerate(self.kv_lens.tolist()):
            if n == 0:
                outs.append(torch.zeros(HEADS, V, dtype=torch.float64, device=DEVICE))
                continue
            pos = torch.arange(n, device=DEVICE)
            rows = self.cache[self.page_table[r, pos // PS].long(), pos % PS, 0].double()
            c, k_rope = rows.split([RANK, ROPE], dim=-1)  # [n, R], [n, P]
            k = torch.cat(
                (torch.einsum("lr,hnr->lhn", c, w_uk), k_rope[:, None].expand(n, HEADS, ROPE)), -1
            )
            q = torch.cat((self.q_nope[r], self.q_rope[r]), -1).double()  # [H, N + P]
            probs = (torch.einsum("hd,lhd->hl", q, k) * self.scale).softmax(-1)
            outs.append(torch.einsum("hl,lhv->hv", probs, torch.einsum("lr,hvr->lhv", c, w_uv)))
        return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_equals_expanded(dtype: torch.dtype):
    case = Case(dtype, LENGTHS)
    q_latent = absorb_query(case.q_nope, case.w_uk)  # [rows, H, R], strided (heads first)
    assert not q_latent.is_contiguous()
    ref = latent_decode_torch(
        q_latent, case.q_rope, case.cache, case.page_table, case.kv_lens, case.scale
    )
    assert ref.dtype == dtype and ref[-1].eq(0).all()  # the padded row: zeros
    tol = TOL[dtype]
    expanded = case.expanded()
    torch.testing.assert_close(expand_output(ref, case.w_uv).double(), expanded, atol=tol, rtol=tol)
    for splits in SPLITS if dtype == torch.float32 else SPLITS[-1:]:
        out = case.kernel(q_latent, splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol, msg=f"{splits} splits")
        absorbed = expand_output(out, case.w_uv).double()
        torch.testing.assert_close(absorbed, expanded, atol=tol, rtol=tol, msg=f"{splits}")


def test_a_split_past_every_row_s_end_weighs_nothing():
    """Rows of 1 and 5 keys cut 3 ways in blocks of 16: splits 1 and 2 are empty."""
    case = Case(torch.float32, (1, 5), seed=1)
    q_latent = absorb_query(case.q_nope, case.w_uk).contiguous()
    ref = latent_decode_torch(
        q_latent, case.q_rope, case.cache, case.page_table, case.kv_lens, case.scale
    )
    torch.testing.assert_close(case.kernel(q_latent, 3), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case.kernel(q_latent, 3), case.kernel(q_latent, 1))


def test_shapes_that_do_not_fit_are_refused():
    case = Case(torch.float32, (5,))
    q_latent = torch.zeros(2, HEADS, RANK, device=DEVICE)
    args = (case.cache, case.page_table, case.kv_lens, torch.empty_like(q_latent), 1.0)
    with pytest.raises(ValueError, match=r"do not fit a latent cache"):
        paged_latent_decode(q_latent, case.q_rope[:, :, :-1], *args)
    with pytest.raises(ValueError, match="2 splits need partial buffers"):
        paged_latent_decode(q_latent, case.q_rope, *args, num_splits=2)
    with pytest.raises(ValueError, match="block_h must be a power of two"):
        paged_latent_decode(q_latent, case.q_rope, *args, block_h=24)
    llama = KVLayout.llama("float32", PS, 2, 2, 16)
    with pytest.raises(ValueError, match="'latent' buffer"):
        MLABackend(KVPool(llama, 4, DEVICE), LlamaShape)


class LlamaShape:
    num_heads, num_kv_heads, head_dim = 2, 2, 16


def test_tiny_deepseek_decodes_absorbed_as_it_decodes_expanded(builtin_dir):
    """deepseek-v3-tiny (YaRN mscale in the softmax scale), float32: a prefill step of three
    prompts (4, 13 and 36 tokens), then three steps of their decodes. The `triton` backend
    (each kernel) absorbs the decode steps only, and its hidden states equal the `torch`
    backend's expanded ones to 1e-5; the pools hold the same latents."""
    path: Path = builtin_dir("deepseek-v3-tiny")
    model = load_model(path, torch.float32, DEVICE)
    arch = model.arch
    assert arch.mla is not None
    layout = KVLayout.for_model(arch, "float32", 4)
    pools = [KVPool(layout, 40, DEVICE) for _ in range(3)]
    triton = make_backend("triton", pools[1], arch)
    assert isinstance(triton, MLABackend) and isinstance(triton, LatentDecodeBackend)
    backends = [
        TorchBackend(pools[0], arch),
        triton,
        MLABackend(pools[2], arch, LatentKernel.TORCH),
    ]
    calls = [0, 0, 0]
    for i, b in enumerate(backends[1:], start=1):
        attend = b.attend_latent

        def counted(*args, i=i, attend=attend):  # type: ignore[no-untyped-def]
            calls[i] += 1
            return attend(*args)

        b.attend_latent = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (4, 13, 36)]
    pages = [[9, 3], [17, 5, 30, 1], [12, 2, 28, 7, 19, 11, 4, 25, 14, 6]]
    builder = BatchBuilder(4, 40, DEVICE)
    steps = [[SeqSpan(p, 0, pg, True) for p, pg in zip(prompts, pages, strict=True)]]
    for k in range(3):
        steps.append(
            [SeqSpan([7 + k], len(p) + k, pg, True) for p, pg in zip(prompts, pages, strict=True)]
        )
    with torch.inference_mode():
        for n, spans in enumerate(steps):
            batch = builder.build(spans)
            hidden = []
            for b in backends:
                meta = b.prepare(batch)
                assert not isinstance(b, MLABackend) or b.absorbs(meta) == (n > 0)
                hidden.append(model(batch.input_ids, batch.positions, AttentionContext(b, meta)))
            for h in hidden[1:]:
                torch.testing.assert_close(h, hidden[0], atol=1e-5, rtol=1e-5)
    assert calls == [0, 3 * arch.num_layers, 3 * arch.num_layers]
    for i in range(arch.num_layers):
        for pool in pools[1:]:
            torch.testing.assert_close(pool.view(i, LATENT), pools[0].view(i, LATENT))
