"""The fp8 block-scaled kernels (kernels/triton_fp8.py) against their torch reference
(kernels/fp8_blocks.py), and when kernels/ops takes them.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET), at small shapes whose last 128-blocks are cut short. The reference always
runs on the CPU (on CUDA torch divides by a Python scalar as a multiply by its reciprocal).
act_quant is compared bit for bit, with its scales as they are and rounded up to powers of
two (`pow2`, DeepSeek's ue8m0 checkpoints). block_linear's float32 output agrees with the
reference's to float32 rounding under the interpreter (only the order of a K block's sum
differs); on a GPU the fp8 tensor cores sum each K block in reduced precision, so the bound
there is looser. bfloat16 outputs agree to one bfloat16 rounding (the interpreter truncates to it).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.kernels import fp8_blocks, ops, triton_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_fp8._block_linear_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

B = fp8_blocks.BLOCK
# largest error over the largest output: float32 rounding in the interpreter, fp8 tensor-core
# accumulation on a GPU; bfloat16 one rounding of the output
BOUND = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-3, torch.bfloat16: 2**-7}
# (O, K): every last block cut short; several O and K blocks; one short K block only
SHAPES = [(300, 200), (256, 384), (130, 64)]
# split K: 2 splits of K blocks (the last cut short); 8 asked, as many as there are K blocks
CONFIGS = [
    None,
    triton_fp8.Config(16, 16, 4, 2),
    triton_fp8.Config(32, 128, 4, 2),
    triton_fp8.Config(16, 32, 4, 2, split_k=2),
    triton_fp8.Config(16, 64, 4, 2, split_k=8),
]


def blocky(rows: int, cols: int, seed: int) -> torch.Tensor:
    """float32 [rows, cols] whose 128 x 128 blocks differ in magnitude by up to 10**6, so
    that a scale read from the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    mags = 10 ** (torch.rand(-(-rows // B), -(-cols // B), generator=g) * 6 - 3)
    spread = mags.repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]
    return torch.randn(rows, cols, generator=g) * spread


def weight(o: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 weight [O, K] and its block scales, on the CPU."""
    return fp8_blocks.quantize_weight(blocky(o, k, seed) / k**0.5)


def on(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in ts]


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp_min(1e-30)
    err = float((got.cpu().float() - want.float()).abs().max() / scale)
    assert err <= BOUND[want.dtype], f"max error {err:.2e} of the largest output"


def assert_same_bits(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    q, s = (t.cpu() for t in got)
    want_q, want_s = want
    assert q.dtype == fp8_blocks.FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == want_q.shape and s.shape == want_s.shape
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).sum()
    assert differ == 0, f"{int(differ)} of {q.numel()} fp8 values differ"
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


# ---------------------------------------------------------------- act_quant


def activations(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that take every path: groups of different magnitudes, an all-zero row, a zero
    group among others, -0.0s, values near the dtype's largest, and groups small enough that
    MIN_AMAX sets their scale (subnormal and zero e4m3 codes)."""
    big = torch.finfo(dtype).max / 2
    tiny = 1e-12 if dtype != torch.float16 else 1e-7  # float16 has no 1e-12
    rows = [blocky(1, k, seed=2)[0], blocky(1, k, seed=3)[0] * 1e3, torch.zeros(k)]
    zero_group = blocky(1, k, seed=4)[0]
    zero_group[:B] = 0.0
    negative_zeros = blocky(1, k, seed=5)[0]
    negative_zeros[::3] = -0.0
    large = torch.randn(k, generator=torch.Generator().manual_seed(6)).clamp(-2, 2) * big / 2
    small = torch.randn(k, generator=torch.Generator().manual_seed(7)) * tiny
    x = torch.stack(rows + [zero_group, negative_zeros, large, small])
    return x.clamp(-big, big).to(dtype)  # finite: the magnitudes above overflow float16


@pytest.mark.parametrize("k", [64, 128, 200, 384, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_act_quant_equals_the_reference_bit_for_bit(k, dtype):
    """K 1100: nine groups, the last of 76, over two programs of eight groups."""
    x = activations(k, dtype)
    assert_same_bits(triton_fp8.act_quant(x.to(DEVICE)), fp8_blocks.act_quant(x))


def test_act_quant_rounds_ties_to_even_and_subnormals():
    """A group whose largest value is FP8_MAX has scale 1: its values are rounded to e4m3 as
    they are. Every midpoint between two neighbouring non-negative e4m3 values (ties, normal
    and subnormal), and each midpoint one float32 step either side, with their negatives."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(fp8_blocks.FP8_DTYPE).float()  # 0..448
    mids = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([mids, mids.nextafter(torch.zeros(1)), mids.nextafter(codes[1:]), codes])
    values = torch.cat([values, -values])
    k = -(-values.numel() // B) * B
    x = torch.zeros(1, k)
    x[0, : values.numel()] = values
    x[0, B - 1 :: B] = fp8_blocks.FP8_MAX  # each group's largest: scale exactly 1
    want = fp8_blocks.act_quant(x)
    assert torch.equal(want[1], torch.ones_like(want[1]))
    assert_same_bits(triton_fp8.act_quant(x.to(DEVICE)), want)


def pow2_above(s: float) -> float:
    """The power of two at or above s > 0, by frexp (s = m * 2**e, m in [0.5, 1)): exact."""
    m, e = math.frexp(s)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


@pytest.mark.parametrize("k", [64, 200, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pow2_act_quant_equals_the_reference_bit_for_bit(k, dtype):
    """Every scale the plain one rounded up to a power of two (frexp's, not the bit trick's),
    and the kernel's bits equal to the reference's."""
    x = activations(k, dtype)
    want = fp8_blocks.act_quant(x, pow2=True)
    plain = fp8_blocks.act_quant(x)[1].flatten().tolist()
    assert want[1].flatten().tolist() == [pow2_above(s) for s in plain]
    assert_same_bits(triton_fp8.act_quant(x.to(DEVICE), pow2=True), want)


def test_pow2_scales_at_powers_of_two_and_either_side():
    """Groups whose largest magnitude is 448 * 2**j (a scale of exactly 2**j, which stays), a
    float32 step above it (the next power), a step below (2**j again), and the groups whose
    amax is clamped to MIN_AMAX (all zeros, 1e-12s, a subnormal): 2**-42, the power above
    MIN_AMAX / 448. The other values of a group spread below its largest, so x / s rounds."""
    rows = []
    for j in (-20, -3, 0, 5):
        top = torch.tensor(fp8_blocks.FP8_MAX * 2.0**j)
        rows += [top, top.nextafter(torch.tensor(math.inf)), top.nextafter(torch.zeros(()))]
    tops = torch.stack(rows + [torch.tensor(0.0), torch.tensor(1e-12), torch.tensor(1e-40)])
    g = torch.Generator().manual_seed(17)
    x = (torch.rand(len(tops), B, generator=g) * 2 - 1) * tops[:, None]
    x[:, 5] = tops
    x[::2, 9] = -tops[::2]  # the largest magnitude negative too
    x = x.reshape(1, -1)
    q, scale = fp8_blocks.act_quant(x, pow2=True)
    want = []
    for j in (-20, -3, 0, 5):
        want += [2.0**j, 2.0 ** (j + 1), 2.0**j]
    assert scale.flatten().tolist() == want + [2.0**-42] * 3
    assert_same_bits(triton_fp8.act_quant(x.to(DEVICE), pow2=True), (q, scale))
    plain_q, plain_scale = fp8_blocks.act_quant(x)
    assert not torch.equal(plain_scale, scale) and not torch.equal(plain_q.float(), q.float())


def test_act_quant_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="act_quant"):
        triton_fp8.act_quant(torch.zeros(4, 256, device=DEVICE).t())  # stride 4 in K
    with pytest.raises(ValueError, match="act_quant"):
        triton_fp8.act_quant(torch.zeros(256, device=DEVICE))


# ---------------------------------------------------------------- block_linear


def quantised_tokens(m: int, k: int, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_blocks.act_quant(blocky(m, k, seed))


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("o, k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_linear_equals_the_reference(m, o, k, out_dtype):
    """M 33 with config_for's 64-row blocks: one partial block; with 16: three."""
    x_q, x_s = quantised_tokens(m, k)
    w, w_s = weight(o, k)
    want = fp8_blocks.block_linear(x_q, x_s, w, w_s, out_dtype)
    for config in CONFIGS:
        got = triton_fp8.block_linear(*on(x_q, x_s, w, w_s), out_dtype, config)
        assert_matches(got, want)


@pytest.mark.parametrize("o, k", SHAPES)
def test_pow2_linear_equals_the_reference(o, k):
    """linear with power-of-two activation scales: the reference's product, and not the plain
    one (whose scales differ: a kernel that dropped pow2 would fail)."""
    x = blocky(5, k, seed=18)
    w, w_s = weight(o, k)
    want = fp8_blocks.linear(x, w, w_s, pow2=True)
    assert torch.equal(
        want, fp8_blocks.block_linear(*fp8_blocks.act_quant(x, pow2=True), w, w_s, torch.float32)
    )
    for config in CONFIGS:
        assert_matches(triton_fp8.linear(*on(x, w, w_s), config, pow2=True), want)
    plain = triton_fp8.linear(*on(x, w, w_s))
    err = float((plain.cpu() - want).abs().max() / want.abs().max())
    assert err > 10 * BOUND[torch.float32], err


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_every_block_n_reads_its_tile_weight_scale(block_n):
    """300 outputs: three weight-scale rows, the last of 44; each BLOCK_N's tiles find theirs."""
    x_q, x_s = quantised_tokens(3, 200)
    w, w_s = weight(300, 200)
    want = fp8_blocks.block_linear(x_q, x_s, w, w_s, torch.float32)
    config = triton_fp8.Config(16, block_n, 4, 2)
    assert_matches(triton_fp8.block_linear(*on(x_q, x_s, w, w_s), torch.float32, config), want)


def excess(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor) -> int:
    """How many outputs lie outside the activation's quantisation error of x @ W.T, W the
    dequantised weight (in float64). Each x_i is off by at most half an e4m3 step: 2**-4 of
    |x_i| when normal, 2**-10 of its group's scale when subnormal; the output by at most the
    sum of those times |W|, plus float32 rounding."""
    w64 = fp8_blocks.dequantize_weight(w, w_s).double()
    _, x_s = fp8_blocks.act_quant(x)
    group_scale = x_s.double().repeat_interleave(B, 1)[:, : x.shape[1]]
    step = 2**-4 * x.double().abs() + 2**-10 * group_scale
    bound = step @ w64.abs().T * 1.001 + 1e-5 * (x.double().abs() @ w64.abs().T)
    return int(((got.cpu().double() - x.double() @ w64.T).abs() > bound).sum())


def test_the_product_is_within_quantisation_error_of_the_float32_one():
    """Blocks of x and W whose magnitudes differ by up to 10**6: the right product is within
    the bound everywhere, and any scale read from the wrong block breaks it."""
    x = blocky(5, 384, seed=11)
    w, w_s = weight(300, 384, seed=12)
    assert excess(triton_fp8.linear(*on(x, w, w_s)), x, w, w_s) == 0
    x_q, x_s = fp8_blocks.act_quant(x)
    wrong = {
        "weight scale rows": (x_s, w_s.flip(0)),
        "weight scale columns": (x_s, w_s.flip(1)),
        "activation scale groups": (x_s.flip(1), w_s),
    }
    for what, (xs, ws) in wrong.items():
        got = triton_fp8.block_linear(*on(x_q, xs, w, ws), torch.float32)
        assert excess(got, x, w, w_s) > 0, f"swapped {what} went unnoticed"


def test_block_linear_refuses_mismatched_operands_and_takes_no_rows():
    x_q, x_s = quantised_tokens(2, 200)
    w, w_s = weight(130, 200)
    with pytest.raises(ValueError, match="block_linear"):
        triton_fp8.block_linear(*on(x_q, x_s, w, w_s[:, :1]), torch.float32)
    with pytest.raises(ValueError, match="block_linear"):
        triton_fp8.block_linear(*on(x_q.float(), x_s, w, w_s), torch.float32)
    empty = triton_fp8.block_linear(*on(x_q[:0], x_s[:0], w, w_s), torch.bfloat16)
    assert empty.shape == (0, 130) and empty.dtype == torch.bfloat16


def test_config_rule():
    """Decode takes the smallest row block that holds its rows, prefill 128; a narrow weight
    narrower tiles, then split K, until the grid fills the GPU; every BLOCK_N divides the
    scale block, and no narrower than twice the rows (up to 64 wide: x's reads); a split has at
    least MIN_SPLIT_BLOCKS K blocks."""
    for m in (1, 16, 17, 32, 64, 65, 4096):
        for n in (576, 1536, 7168, 36864):
            for k in (1536, 7168, 18432):
                c = triton_fp8.config_for(m, n, k)
                assert c.block_m == min(128, max(16, 1 << (m - 1).bit_length()))
                assert B % c.block_n == 0
                programs = -(-m // c.block_m) * -(-n // c.block_n)
                narrowest = triton_fp8.narrowest(m, 128 if m > 64 else 64)
                assert c.block_n >= narrowest and c.block_n >= min(narrowest, 2 * min(m, 32))
                assert c.block_n == narrowest or programs >= triton_fp8.TARGET_PROGRAMS
                if c.split_k > 1:
                    assert (k // B) // c.split_k >= triton_fp8.MIN_SPLIT_BLOCKS
                    assert programs * (c.split_k - 1) < triton_fp8.TARGET_PROGRAMS
    kv_a, wide = triton_fp8.config_for(1, 576, 7168), triton_fp8.config_for(1, 36864, 7168)
    assert kv_a.block_n < wide.block_n and kv_a.split_k > 1 == wide.split_k
    with pytest.raises(ValueError, match="block_n"):
        triton_fp8.Config(16, 48, 4, 2)
    with pytest.raises(ValueError, match="block_m"):
        triton_fp8.Config(8, 16, 4, 2)
    with pytest.raises(ValueError, match="split_k"):
        triton_fp8.Config(16, 16, 4, 2, split_k=0)


# ---------------------------------------------------------------- ops.fp8_linear


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_linear_takes_triton_on_cuda_or_when_forced(monkeypatch, pow2):
    """Which path ran, and the pow2 it was given, are watched, not guessed from the numbers;
    both give the reference's."""
    taken: list[tuple[str, bool]] = []

    def spy(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: torch.Tensor, **kwargs: bool) -> torch.Tensor:
            taken.append((name, kwargs.get("pow2", False)))
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(triton_fp8, "linear", spy("triton", triton_fp8.linear))
    monkeypatch.setattr(fp8_blocks, "linear", spy("torch", fp8_blocks.linear))
    x = blocky(5, 200, seed=13).bfloat16()
    w, w_s = weight(300, 200)
    want = fp8_blocks.block_linear(*fp8_blocks.act_quant(x, pow2=pow2), w, w_s, torch.bfloat16)
    xd, wd, w_sd = on(x, w, w_s)
    monkeypatch.delenv(ops.FP8_TRITON_ENV, raising=False)
    assert_matches(ops.fp8_linear(xd, wd, w_sd, pow2), want)
    assert taken == [("triton" if DEVICE == "cuda" else "torch", pow2)]
    for forced, path in (("1", "triton"), ("0", "torch")):
        monkeypatch.setenv(ops.FP8_TRITON_ENV, forced)
        taken.clear()
        assert_matches(ops.fp8_linear(xd, wd, w_sd, pow2), want)
        assert taken == [(path, pow2)]
    monkeypatch.setenv(ops.FP8_TRITON_ENV, "1")
    strided = xd.t().contiguous().t()  # unit stride along N, not K
    assert_matches(ops.fp8_linear(strided, wd, w_sd, pow2), want)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
def test_on_cuda_no_host_sync_and_a_cuda_graph_replays_new_tokens():
    w, w_s = on(*weight(300, 200))
    x = blocky(5, 200, seed=14).bfloat16().cuda()
    triton_fp8.linear(x, w, w_s)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_fp8.linear(x, w, w_s)  # a host sync would raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8.linear(static, w, w_s)
    for seed in (15, 16):
        static.copy_(blocky(5, 200, seed=seed).bfloat16())
        graph.replay()
        assert torch.equal(out, triton_fp8.linear(static, w, w_s))
