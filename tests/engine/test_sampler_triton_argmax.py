"""The greedy pick on CUDA (sampling/triton_argmax.py) is torch's argmax, bit for bit: ties go
to the first index, NaN counts greatest (the first NaN wins), -inf rows pick 0, and a 16-bit
row picks what its float32 copy picks. The sampler takes it for greedy rows.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets it), with a
small CHUNK so that rows span several chunks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from pdserve.attention.triton_common import interpreted  # noqa: E402
from pdserve.engine.sampling import processors, triton_argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted(triton_argmax._argmax_chunk_kernel):
    pytest.skip("Triton kernels imported compiled without a GPU", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, vocab): one token, a chunk's edge -1/0/+1, several chunks with a ragged last one
SHAPES = [(1, 1), (3, 63), (2, 64), (2, 65), (4, 1000)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    if DEVICE == "cpu":  # the interpreter is slow; compiled, the real CHUNK runs below too
        monkeypatch.setattr(triton_argmax, "CHUNK", 64)


def check(x: torch.Tensor) -> None:
    got = triton_argmax.argmax(x.to(DEVICE)).cpu()
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_random_rows(rows, vocab, dtype):
    g = torch.Generator().manual_seed(rows * vocab)
    check((torch.randn(rows, vocab, generator=g) * 5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_ties_go_to_the_first_index(rows, vocab, dtype):
    g = torch.Generator().manual_seed(7)
    check(torch.randint(0, 3, (rows, vocab), generator=g).to(dtype))  # many equal maxima
    check(torch.zeros(rows, vocab, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_and_masked_rows(dtype):
    vocab = 300  # several chunks
    x = torch.randn(5, vocab).to(dtype)
    x[0, 7] = x[0, 250] = float("nan")  # the first NaN wins, even over inf
    x[0, 100] = float("inf")
    x[1, 200] = float("inf")
    x[2] = float("-inf")  # every token masked: index 0
    x[3, 150:] = float("nan")  # a NaN in a later chunk than the max
    x[4, :] = -3.0
    x[4, 299] = -2.0  # the last token of a ragged last chunk
    check(x)


def test_a_16_bit_row_picks_what_its_float32_copy_picks():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 500, generator=g) * 8).to(torch.bfloat16)  # bf16: many near-ties
    got = triton_argmax.argmax(x.to(DEVICE)).cpu()
    assert torch.equal(got, x.float().argmax(dim=-1))


def test_bad_logits_are_refused():
    for bad in (torch.zeros(3), torch.zeros(2, 0), torch.zeros(4, 6).t()):
        with pytest.raises(ValueError, match="argmax"):
            triton_argmax.argmax(bad.to(DEVICE))


def test_the_sampler_greedy_pick_takes_it_on_cuda_only():
    x = torch.randn(3, 130)
    called = []
    real = triton_argmax.argmax

    def spy(logits: torch.Tensor) -> torch.Tensor:
        called.append(logits.shape)
        return real(logits)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_argmax, "argmax", spy)
        got = processors.greedy(x.to(DEVICE)).cpu()
    assert torch.equal(got, x.argmax(dim=-1))
    assert called == ([(3, 130)] if DEVICE == "cuda" else [])
