"""The loader opens each safetensors file once per load (model/loader.py), fp8 scales included,
also when a weight's scale sits in another shard; the values are the dequantised weights."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pdserve.model import safetensors_file
from pdserve.model.loader import Fp8Scale, checkpoint_tensors, copy_placements
from pdserve.model.safetensors_file import OpenFiles
from pdserve.model.weight_map import Placement, Whole

BLOCK = (2, 2)


def fp8(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 weight and its float32 block scales (w = fp8 * scale)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 8).to(torch.float8_e4m3fn)
    s = torch.rand(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]), generator=g) + 0.5
    return w, s


def dequantised(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    full = s.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return w.float() * full


def test_each_file_is_opened_once_per_load(tmp_path: Path, monkeypatch) -> None:
    (w1, s1), (w2, s2), (w3, s3) = fp8(4, 6, 1), fp8(5, 3, 2), fp8(2, 2, 3)
    plain = torch.arange(6, dtype=torch.float32)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    # Shard a: three fp8 weights and two scales; w2's scale is in shard b, beside a plain tensor.
    save_file({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3,
               "w1.weight_scale_inv": s1, "w3.weight_scale_inv": s3}, str(a))  # fmt: skip
    save_file({"w2.weight_scale_inv": s2, "plain": plain}, str(b))
    stored = checkpoint_tensors([a, b])
    scales = {
        f"w{i}.weight": Fp8Scale(stored.pop(f"w{i}.weight_scale_inv"), BLOCK) for i in (1, 2, 3)
    }
    params = {
        "w1": nn.Parameter(torch.empty(4, 6), requires_grad=False),
        "w2": nn.Parameter(torch.empty(5, 3), requires_grad=False),
        "w3": nn.Parameter(torch.empty(2, 2), requires_grad=False),
        "plain": nn.Parameter(torch.empty(6), requires_grad=False),
    }
    placements = [Placement(f"w{i}.weight", f"w{i}", Whole()) for i in (1, 2, 3)]
    placements.append(Placement("plain", "plain", Whole()))

    opened: list[str] = []

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(file).name)
        return builtins.open(file, *args, **kwargs)

    # OpenFiles' `open` (model/safetensors_file.py), through which the loader reads
    monkeypatch.setattr(safetensors_file, "open", counting_open, raising=False)
    copy_placements(stored, placements, params, scales)
    assert sorted(opened) == ["a.safetensors", "b.safetensors"]
    assert torch.equal(params["w1"], dequantised(w1, s1))
    assert torch.equal(params["w2"], dequantised(w2, s2))
    assert torch.equal(params["w3"], dequantised(w3, s3))
    assert torch.equal(params["plain"], plain)


def test_open_files_close_after_the_last_read_and_refuse_a_read_past_it(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    a.write_bytes(b"x")
    with OpenFiles([a, a]) as files:
        f = files.get(a)
        assert files.get(a) is f
        files.done(a)
        assert not f.closed
        files.done(a)
        assert f.closed
        with pytest.raises(RuntimeError, match="after its last planned read"):
            files.get(a)
