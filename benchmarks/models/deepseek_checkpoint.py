"""A DeepSeek-V3 / V3.2 checkpoint at DeepSeek-V3's real per-layer dims but a few layers, so
that it fits one GPU, written fast (issue 39 item 6): the benchmarks' `real-v3` / `real-v32`.

    python benchmarks/models/deepseek_checkpoint.py --arch v3 [--moe-layers 2] [--fp8]
    python benchmarks/models/deepseek_checkpoint.py --arch v32 --scale smoke --device cpu

The directory (an HF one, which pdserve and transformers both load):
  * config.json: the built-in deepseek-v3-tiny's (deepseek-v32-tiny's) with DeepSeek-V3's
    dims (REAL: hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128,
    256 routed experts, top-8 in 8 groups of which 4 kept, moe_intermediate 2048, 1 shared
    expert, a dense layer of 18432) and its YaRN rope; `num_hidden_layers` = 1 + moe_layers
    (the first dense); V3.2 adds 64 indexer heads of 128, index_topk 2048. The vocabulary is
    the tiny tokenizer's 4,096, not DeepSeek's 129,280 (whose embedding and head would be
    1.85 GB each, and a tokenizer we cannot ship): the tokenizer files are the built-in's.
  * safetensors shards of at most SHARD_BYTES with HF's checkpoint names, per-expert
    (`model.layers.1.mlp.experts.3.gate_proj.weight`) as DeepSeek's own checkpoints are. Each
    tensor is drawn on `device` from torch.randn seeded by its name (times 0.02, HF's
    initializer_range), norms ones, biases (the router's correction bias, the indexer's
    LayerNorm bias) zeros, and written at once: host memory holds one tensor, never a shard,
    and no model is built (HF's CPU init of 24 G parameters takes many minutes).
  * `--fp8`: every linear weight DeepSeek stores in fp8 (the attention projections, the
    MLPs, every expert, the indexer's wq_b and wk) as float8_e4m3fn with a float32
    `weight_scale_inv` per 128 x 128 block (kernels/fp8_blocks.py `quantize_weight`), and
    config.json's quantization_config says so. The embedding, head, norms, router and the
    indexer's weights_proj stay bf16 (the router's bias float32), as in DeepSeek's files.
Same spec, same device type, same torch: the same bytes (each tensor's generator is seeded by
crc32 of its name; CUDA's and the CPU's generators differ). `real` with 2 MoE layers is 23.6 G
parameters: 47 GB in bf16, 24 GB in fp8.

`generated()` writes one under `root` (default: /dev/shm/pdserve-bench where /dev/shm has the
room, a temporary directory's otherwise), reuses a complete one already there, and deletes what
it wrote when the block ends unless `keep`. Run as a script, it writes one and keeps it.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import shutil
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.kernels.fp8_blocks import BLOCK, quantize_weight  # noqa: E402
from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.model.builtin_weights import FP8_QUANTIZATION_CONFIG, FP8_STORED  # noqa: E402
from pdserve.model.safetensors_file import SAFETENSORS_DTYPES  # noqa: E402

# DeepSeek-V3's per-layer dims (its config.json), and V3.2's indexer.
REAL: dict[str, Any] = {
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "head_dim": 64, "v_head_dim": 128,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
}  # fmt: skip
REAL_V32: dict[str, Any] = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
# The same code at a CPU's scale (hidden 256, 8 experts): what a smoke run writes.
SMOKE: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "head_dim": 16, "v_head_dim": 32, "moe_intermediate_size": 128,
    "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5,
}  # fmt: skip
SMOKE_V32: dict[str, Any] = {"index_n_heads": 8, "index_head_dim": 32, "index_topk": 32}
DIMS = {"real": (REAL, REAL_V32), "smoke": (SMOKE, SMOKE_V32)}
ROPE: dict[str, Any] = {  # DeepSeek-V3's
    "rope_theta": 10000.0, "max_position_embeddings": 163840,
    "rope_scaling": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}  # fmt: skip
FP8_QUANT = FP8_QUANTIZATION_CONFIG
FP8_LINEAR = FP8_STORED  # the linear weights DeepSeek's fp8 checkpoints store in fp8
STD = 0.02  # HF's initializer_range
SHARD_BYTES = 4 << 30  # about DeepSeek's own shards' size
COMPLETE = ".complete"  # written last: the spec of a finished directory
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class CheckpointSpec:
    arch: str  # "v3" or "v32"
    moe_layers: int = 2
    scale: str = "real"  # "real" or "smoke"
    fp8: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("v3", "v32"):
            raise ValueError(f"arch must be 'v3' or 'v32', got {self.arch!r}")
        if self.scale not in DIMS:
            raise ValueError(f"scale must be one of {sorted(DIMS)}, got {self.scale!r}")
        if self.moe_layers < 1:
            raise ValueError(f"moe_layers must be >= 1, got {self.moe_layers}")

    @property
    def name(self) -> str:
        return f"{self.scale}-{self.arch}-moe{self.moe_layers}" + ("-fp8" if self.fp8 else "")


class Init(enum.Enum):
    NORMAL = "normal"  # randn * STD
    ONES = "ones"
    ZEROS = "zeros"


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor; an `fp8` one is stored as itself in e4m3 plus its block scales."""

    name: str
    shape: tuple[int, ...]
    init: Init = Init.NORMAL
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = False

    def stored(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of what the file holds for it, in write order."""
        if not self.fp8:
            return [(self.name, self.dtype, self.shape)]
        o, k = self.shape
        scales = (-(-o // BLOCK), -(-k // BLOCK))
        scale_name = self.name.removesuffix("weight") + "weight_scale_inv"
        return [(self.name, torch.float8_e4m3fn, self.shape), (scale_name, torch.float32, scales)]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.stored())

    def values(self, device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
        """The tensors `stored` names, drawn on `device`."""
        if self.init is Init.NORMAL:
            g = torch.Generator(device=device)
            g.manual_seed(seed * 2**32 + zlib.crc32(self.name.encode()))
            w = torch.randn(self.shape, generator=g, device=device).mul_(STD)  # float32
        else:
            fill = torch.ones if self.init is Init.ONES else torch.zeros
            w = fill(self.shape, device=device)
        if not self.fp8:
            return [(self.name, w.to(self.dtype))]
        q, scale = quantize_weight(w)
        (name, _, _), (scale_name, _, _) = self.stored()
        return [(name, q), (scale_name, scale)]


# ---------------------------------------------------------------- config and tensors


def hf_config(spec: CheckpointSpec) -> dict[str, Any]:
    """The built-in tiny model's config.json with `spec`'s dims (module docstring)."""
    tiny = resolve_model(f"builtin:deepseek-{spec.arch}-tiny")
    cfg: dict[str, Any] = json.loads((tiny / "config.json").read_text())
    dims, v32 = DIMS[spec.scale]
    cfg.update(dims, **ROPE, num_hidden_layers=1 + spec.moe_layers, first_k_dense_replace=1)
    cfg["torch_dtype"] = "bfloat16"
    if spec.arch == "v32":
        cfg.update(v32)
    if spec.fp8:
        cfg["quantization_config"] = FP8_QUANT
    return cfg


def tensor_specs(cfg: dict[str, Any], fp8: bool) -> list[TensorSpec]:
    """Every checkpoint tensor of `cfg`, in file order (HF's names; per-expert experts)."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    out = [TensorSpec("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        out += layer_specs(cfg, i)
    out += [
        TensorSpec("model.norm.weight", (h,), Init.ONES),
        TensorSpec("lm_head.weight", (vocab, h)),
    ]
    if fp8:
        out = [replace(t, fp8=True) if FP8_LINEAR.fullmatch(t.name) else t for t in out]
    return out


def layer_specs(cfg: dict[str, Any], i: int) -> list[TensorSpec]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
    out = [
        TensorSpec(f"{p}.input_layernorm.weight", (h,), Init.ONES),
        TensorSpec(f"{a}.q_a_proj.weight", (q_lora, h)),
        TensorSpec(f"{a}.q_a_layernorm.weight", (q_lora,), Init.ONES),
        TensorSpec(f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora)),
        TensorSpec(f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
        TensorSpec(f"{a}.kv_a_layernorm.weight", (kv_lora,), Init.ONES),
        TensorSpec(f"{a}.kv_b_proj.weight", (heads * (nope + v), kv_lora)),
        TensorSpec(f"{a}.o_proj.weight", (h, heads * v)),
    ]
    if "index_topk" in cfg:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        out += [
            TensorSpec(f"{a}.indexer.wq_b.weight", (ih * idim, q_lora)),
            TensorSpec(f"{a}.indexer.wk.weight", (idim, h)),
            TensorSpec(f"{a}.indexer.k_norm.weight", (idim,), Init.ONES),
            TensorSpec(f"{a}.indexer.k_norm.bias", (idim,), Init.ZEROS),
            TensorSpec(f"{a}.indexer.weights_proj.weight", (ih, h)),
        ]
    out.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), Init.ONES))
    if i < cfg["first_k_dense_replace"]:
        return out + mlp_specs(f"{p}.mlp", h, cfg["intermediate_size"])
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out += [
        TensorSpec(f"{p}.mlp.gate.weight", (e, h)),
        TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (e,), Init.ZEROS, torch.float32),
    ]
    out += mlp_specs(f"{p}.mlp.shared_experts", h, inter * cfg["n_shared_experts"])
    for x in range(e):
        out += mlp_specs(f"{p}.mlp.experts.{x}", h, inter)
    return out


def mlp_specs(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.gate_proj.weight", (inter, hidden)),
        TensorSpec(f"{prefix}.up_proj.weight", (inter, hidden)),
        TensorSpec(f"{prefix}.down_proj.weight", (hidden, inter)),
    ]


def checkpoint_bytes(spec: CheckpointSpec) -> int:
    return sum(t.nbytes for t in tensor_specs(hf_config(spec), spec.fp8))


# ---------------------------------------------------------------- writing


def shards(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    """`specs` in order, cut into runs of at most SHARD_BYTES (a bigger tensor alone)."""
    out: list[list[TensorSpec]] = [[]]
    size = 0
    for t in specs:
        if out[-1] and size + t.nbytes > SHARD_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


def write_safetensors(path: Path, specs: list[TensorSpec], device: torch.device, seed: int) -> None:
    """One safetensors file of `specs`: the header first (every shape is known), then each
    tensor's bytes as it is drawn."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in (s for t in specs for s in t.stored()):
        n = math.prod(shape) * dtype.itemsize
        entry = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape)}
        header[name] = {**entry, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in specs:
            for name, value in t.values(device, seed):
                want = header[name]
                got = {"dtype": SAFETENSORS_NAMES[value.dtype], "shape": list(value.shape)}
                if got != {"dtype": want["dtype"], "shape": want["shape"]}:
                    raise RuntimeError(f"{name}: drew {got}, the header says {want}")
                f.write(value.contiguous().cpu().view(torch.uint8).numpy().data)


@dataclass(frozen=True)
class Written:
    path: Path
    nbytes: int
    seconds: float  # writing it (0: reused)
    reused: bool


def write_checkpoint(spec: CheckpointSpec, path: Path, device: torch.device) -> Written:
    """`spec`'s directory at `path`; one already complete there (its marker names this spec)
    is reused, anything else there is replaced."""
    marker = path / COMPLETE
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        return Written(path, checkpoint_bytes(spec), 0.0, True)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    t0 = time.perf_counter()
    cfg = hf_config(spec)
    tiny = resolve_model(f"builtin:deepseek-{spec.arch}-tiny")
    for f in tiny.iterdir():  # tokenizer and generation config
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    specs = tensor_specs(cfg, spec.fp8)
    runs = shards(specs)
    weight_map: dict[str, str] = {}
    for k, run in enumerate(runs, start=1):
        filename = f"model-{k:05d}-of-{len(runs):05d}.safetensors"
        write_safetensors(path / filename, run, device, spec.seed)
        weight_map.update({name: filename for t in run for name, _, _ in t.stored()})
    nbytes = sum(t.nbytes for t in specs)
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    marker.write_text(json.dumps(asdict(spec)))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the drawing's blocks, before a model loads
    return Written(path, nbytes, time.perf_counter() - t0, False)


def default_root(need: int) -> Path:
    """/dev/shm/pdserve-bench if /dev/shm has room for `need` bytes (and 1 GiB more), else
    the temporary directory's pdserve-bench if it has."""
    free = {}
    for base in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        if base.is_dir():
            free[base] = shutil.disk_usage(base).free
            if free[base] >= need + (1 << 30):
                return base / "pdserve-bench"
    have = ", ".join(f"{b} {n / 1e9:.1f} GB free" for b, n in free.items())
    raise RuntimeError(f"the checkpoint needs {need / 1e9:.1f} GB: {have}; pass a --root")


@contextmanager
def generated(
    spec: CheckpointSpec, device: torch.device, root: Path | None = None, keep: bool = False
) -> Iterator[Written]:
    """`spec`'s checkpoint under `root` while the block runs; what this wrote is deleted at
    its end unless `keep` (a reused one stays)."""
    need = checkpoint_bytes(spec)
    base = root if root is not None else default_root(need)
    written = write_checkpoint(spec, base / spec.name, device)
    try:
        yield written
    finally:
        if not keep and not written.reused:
            shutil.rmtree(written.path)


def describe(spec: CheckpointSpec, written: Written) -> str:
    """One line for a benchmark's output: what the model is, and what writing it took."""
    cfg = hf_config(spec)
    how = "reused" if written.reused else f"written in {written.seconds:.1f} s"
    dtype = "fp8 blocks" if spec.fp8 else "bf16"
    return (
        f"{spec.name}: DeepSeek-V3{'.2' if spec.arch == 'v32' else ''}'s {spec.scale} layer "
        f"dims (hidden {cfg['hidden_size']}, {cfg['n_routed_experts']} experts), 1 dense + "
        f"{spec.moe_layers} MoE layers, vocabulary {cfg['vocab_size']:,} (the tiny tokenizer's, "
        f"not DeepSeek's 129,280); {written.nbytes / 1e9:.2f} GB {dtype} at {written.path}, {how}"
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The generator's options, shared by the benchmarks that use it."""
    ap.add_argument("--moe-layers", type=int, default=2, help="real-*: MoE layers after the dense")
    ap.add_argument("--scale", default="real", choices=sorted(DIMS), help="real-*: the dims")
    ap.add_argument("--fp8", action="store_true", help="real-*: block-fp8 linear weights")
    ap.add_argument("--root", type=Path, default=None, help="real-*: where to write")
    ap.add_argument("--keep", action="store_true", help="real-*: keep what was written")
    ap.add_argument("--write-device", default=None, help="real-*: where tensors are drawn")


def spec_of(model: str, args: argparse.Namespace) -> CheckpointSpec:
    """`real-v3` / `real-v32` with add_arguments' options."""
    return CheckpointSpec(model.removeprefix("real-"), args.moe_layers, args.scale, args.fp8)


def write_device(args: argparse.Namespace) -> torch.device:
    if args.write_device:
        return torch.device(args.write_device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", default="v3", choices=["v3", "v32"])
    add_arguments(ap)
    args = ap.parse_args(argv)
    spec = spec_of(f"real-{args.arch}", args)
    with generated(spec, write_device(args), args.root, keep=True) as written:
        print(describe(spec, written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
