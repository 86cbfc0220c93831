"""Load an HF checkpoint directory (single or sharded safetensors) into a CausalLM; or a GGUF
file, whose tensors model/gguf_file.py reads in HF's names and layout, dequantised.

Peak memory is the model in its final dtype plus one read chunk (CHUNK_BYTES):
  * the model is built on the meta device and each parameter is then created empty, in the
    target dtype, on the target device; tied parameters are tied first, so they get one tensor;
  * weight_map.plan() pairs checkpoint tensors with parameters and checks every name and shape
    before a byte is read;
  * each tensor is read from its file in chunks into one reused buffer and copied (cast on the
    way) into its destination.
We read the files with plain reads rather than safetensors' safe_open: safe_open maps the whole
file, and every page a tensor touches stays resident, counted in the process's RSS, until the
handle closes: about 600 MiB over the model for qwen2-0.5b-shape's first shard (see
benchmarks/models/load_memory.py). The safetensors format is an
8-byte little-endian header length, a JSON header (dtype, shape, data_offsets per tensor) and
the raw little-endian bytes of each tensor in C order.

Also (DeepSeek-V3 and V3.2 checkpoints; V3.2's indexer weights load by name, its weights_proj
kept float32 like the router's): fp8 block-quantised weights (`quantization_config` fp8 with a
`weight_block_size`) are dequantised on load, weight times its `weight_scale_inv` block by
block, one tensor at a time; the weights of multi-token prediction layers (the
`num_nextn_predict_layers` layers after the last; DeepSeek-V4's `mtp.*` modules) are skipped
with one log line, as vLLM does: pdserve does not run MTP, and the model without them is the
whole model. DeepSeek-V4's hash-routing tables (tid2eid) load as integers.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import torch
from torch import nn

from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.deepseek_v32 import DeepseekV32ForCausalLM
from pdserve.model.gguf_file import GGUFFile, find_gguf, open_gguf
from pdserve.model.llama import CausalLM, rope_inv_freq
from pdserve.model.weight_map import Placement, plan, rules_for

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
CHUNK_BYTES = 16 << 20


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"{path}: shards listed in the index are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelConfigError(
        f"{path}: no weights found (expected model.safetensors or model.safetensors.index.json)"
    )


@dataclass(frozen=True)
class StoredTensor:
    """Where a checkpoint tensor's bytes are: `offset` is absolute within `file`."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, StoredTensor]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(size - 8, MAX_HEADER_BYTES):
            raise ModelConfigError(f"{file}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{file}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ModelConfigError(f"{file}: safetensors header is not a JSON object")
    out: dict[str, StoredTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelConfigError(f"{file.name}: tensor {name}: bad header entry {entry}") from e
        if code not in SAFETENSORS_DTYPES:
            raise ModelConfigError(
                f"{file.name}: tensor {name} has dtype {code}; "
                f"supported: {list(SAFETENSORS_DTYPES)}"
            )
        dtype = SAFETENSORS_DTYPES[code]
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or 8 + n + end > size:
            raise ModelConfigError(
                f"{file.name}: tensor {name} ({code}, shape {shape}) has byte range "
                f"[{begin}, {end}) that does not fit its shape or the {size}-byte file"
            )
        out[name] = StoredTensor(file, 8 + n + begin, dtype, shape)
    return out


def checkpoint_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    out: dict[str, StoredTensor] = {}
    for f in files:
        for name, t in read_header(f).items():
            if name in out:
                raise ModelConfigError(f"tensor {name} is in both {out[name].file} and {f}")
            out[name] = t
    return out


LoadedModel: TypeAlias = CausalLM | DeepseekV3ForCausalLM | DeepseekV4ForCausalLM


def empty_model(arch: ModelArch, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """The model with uninitialised parameters, each allocated once in `dtype` on `device`
    (tied parameters share one tensor; the model's FLOAT32_PARAMS in float32), and its derived
    buffers computed."""
    if arch.v4 is not None and dtype == torch.float16:
        # HF keeps V4's compressor and indexer projections in float32 under float16.
        raise ModelConfigError(f"{arch.architecture} runs in float32 or bfloat16, not float16")
    with torch.device("meta"):
        model: LoadedModel = (
            DeepseekV4ForCausalLM(arch)
            if arch.v4 is not None
            else CausalLM(arch)
            if arch.family != "deepseek_v3"
            else DeepseekV32ForCausalLM(arch)
            if arch.dsa is not None
            else DeepseekV3ForCausalLM(arch)
        )
    model.tie_weights()
    keep32 = getattr(model, "FLOAT32_PARAMS", ())
    # Module.to_empty would untie (one new tensor per module), so replace parameters here.
    made: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            want = torch.float32 if name.endswith(keep32) and keep32 else dtype
            if not p.dtype.is_floating_point:  # an index table (V4's tid2eid) keeps its type
                want = p.dtype
            data = torch.empty(p.shape, dtype=want, device=device)
            made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, made[id(p)])
    # Derived buffers, never in a checkpoint. The RoPE table stays float32 like the reference.
    if isinstance(model, CausalLM):
        model.inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        model.inv_freq = model.inv_freq.to(device)
    else:
        model.derive_buffers(device)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"the loader does not compute buffers {left} of {type(model).__name__}")
    return model


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """An HF directory's model, or a GGUF file's (a .gguf, or a directory holding one)."""
    gguf = find_gguf(path)
    if gguf is not None:
        return _load_gguf(open_gguf(gguf), dtype, device)
    arch = ModelArch.from_dir(path)
    stored = checkpoint_tensors(weight_files(path))
    _skip_mtp_layers(stored, arch)
    if arch.v4 is not None:
        _skip_mtp_modules(stored)
    scales = _fp8_scales(stored, arch, str(path))
    model = empty_model(arch, dtype, device)
    shapes = {name: t.shape for name, t in stored.items()}
    placements, params = _plan(model, shapes, arch, str(path))
    copy_placements(stored, placements, params, scales)
    model.eval()
    log.info(
        "loaded %s (%s) from %s on %s as %s", arch.architecture, arch.family, path, device, dtype
    )
    return model


def _plan(
    model: LoadedModel, shapes: dict[str, tuple[int, ...]], arch: ModelArch, where: str
) -> tuple[list[Placement], dict[str, nn.Parameter]]:
    """weight_map.plan() for `model`'s parameters (one name per tensor: a tied lm_head is an
    alias, not a parameter), and the parameters by name."""
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    targets = {name: tuple(p.shape) for name, p in params.items()}
    return plan(shapes, targets, rules_for(arch.architecture), aliases, where=where), params


def _load_gguf(file: GGUFFile, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """A GGUF file's tensors (model/gguf_file.py: HF names and layout, dequantised to float32
    one at a time) placed by the same plan as a directory's, and its rotary frequencies."""
    arch = ModelArch.from_hf_config(file.hf_config(), where=str(file.path))
    model = empty_model(arch, dtype, device)
    placements, params = _plan(model, file.shapes(), arch, str(file.path))
    with torch.no_grad():
        for p in placements:
            p.destination(params[p.target]).copy_(torch.from_numpy(file.read(p.source)))
    divisors = file.rope_freq_divisors()  # [head_dim / 2]: Llama 3's rope scaling, llama.cpp's way
    if divisors is not None and isinstance(model, CausalLM):
        model.inv_freq = model.inv_freq / torch.from_numpy(divisors).to(model.inv_freq.device)
    model.eval()
    log.info("loaded %s from %s (%s) on %s as %s", arch.architecture, file.path,
             file.stored_types(), device, dtype)  # fmt: skip
    return model


def copy_placements(
    stored: dict[str, StoredTensor],
    placements: list[Placement],
    params: dict[str, nn.Parameter],
    scales: dict[str, Fp8Scale] | None = None,
) -> None:
    """Fill each placement's destination from its file, file by file, in offset order; a
    source with an fp8 scale (`scales`) is dequantised on the way. Each file is opened once
    (its scales may sit in another shard) and closed after its last read."""
    scales = scales or {}
    by_file: dict[Path, list[Placement]] = defaultdict(list)
    for p in placements:
        by_file[stored[p.source].file].append(p)
    reads = [stored[p.source].file for p in placements]
    reads += [scales[p.source].tensor.file for p in placements if p.source in scales]
    bounce = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    with torch.no_grad(), OpenFiles(reads) as files:
        for file, group in sorted(by_file.items()):
            for p in sorted(group, key=lambda p: stored[p.source].offset):
                dst = p.destination(params[p.target])
                t = stored[p.source]
                if p.source in scales:
                    scale = scales[p.source]
                    dst.copy_(_dequantised(files.get(file), t, files.get(scale.tensor.file), scale))
                    files.done(scale.tensor.file)
                else:
                    bounce = _copy_tensor(files.get(file), t, dst, bounce)
                files.done(file)


class OpenFiles:
    """The checkpoint files a load reads, each opened at its first read and closed after its
    last (`reads` lists the file of every read, one entry per read): no file is opened twice,
    and no more stay open than the reads still need. All are closed on exit."""

    def __init__(self, reads: list[Path]) -> None:
        self._left = Counter(reads)
        self._open: dict[Path, io.FileIO] = {}

    def get(self, file: Path) -> io.FileIO:
        if file not in self._open:
            if self._left[file] < 1:
                raise RuntimeError(f"{file}: read after its last planned read")
            self._open[file] = open(file, "rb", buffering=0)  # noqa: SIM115 - closed by done()
        return self._open[file]

    def done(self, file: Path) -> None:
        """One read of `file` finished; the last one closes it."""
        self._left[file] -= 1
        if self._left[file] == 0:
            self._open.pop(file).close()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _copy_tensor(
    f: io.FileIO, t: StoredTensor, dst: torch.Tensor, bounce: torch.Tensor
) -> torch.Tensor:
    """Read `t` into `dst` (same shape, any dtype, device or strides) in chunks of whole rows
    through `bounce`; returns the buffer, grown if one row did not fit."""
    if dst.numel() == 0:
        return bounce
    rows = dst if dst.dim() > 0 else dst.unsqueeze(0)  # [R, ...]
    row_bytes = math.prod(rows.shape[1:]) * t.dtype.itemsize
    if row_bytes > bounce.numel():
        bounce = torch.empty(row_bytes, dtype=torch.uint8)
    per_chunk = bounce.numel() // row_bytes
    f.seek(t.offset)
    for r0 in range(0, rows.shape[0], per_chunk):
        n = min(per_chunk, rows.shape[0] - r0)
        chunk = bounce[: n * row_bytes]
        view = chunk.numpy().data  # a writable memoryview of the chunk
        got = 0
        while got < len(view):
            k = f.readinto(view[got:])
            if not k:
                raise ModelConfigError(f"{t.file}: ends inside tensor data at byte {t.offset}")
            got += k
        rows[r0 : r0 + n].copy_(chunk.view(t.dtype).view(n, *rows.shape[1:]))
    return bounce


# ---------------------------------------------------------------- DeepSeek checkpoints

_LAYER_OF = re.compile(r"model\.layers\.(\d+)\.")


def _skip_mtp_layers(stored: dict[str, StoredTensor], arch: ModelArch) -> None:
    """Drop the tensors of the `mtp_layers` layers after the last (DeepSeek's multi-token
    prediction modules), with one log line; other layers past the last stay (and are
    refused by the plan as tensors matching no parameter)."""
    mtp = range(arch.num_layers, arch.num_layers + arch.mtp_layers)
    dropped = [n for n in stored if (m := _LAYER_OF.match(n)) and int(m.group(1)) in mtp]
    for n in dropped:
        del stored[n]
    if dropped:
        log.info(
            "skipping %d tensors of %d multi-token prediction layer(s) (model.layers.%d.*): "
            "pdserve does not run MTP",
            len(dropped),
            arch.mtp_layers,
            arch.num_layers,
        )


_MTP_MODULE = re.compile(r"(^|.*\.)mtp\..*")


def _skip_mtp_modules(stored: dict[str, StoredTensor]) -> None:
    """DeepSeek-V4 keeps its multi-token prediction modules under `mtp.*` (HF ignores them
    on load, and so do we), with one log line."""
    dropped = [n for n in stored if _MTP_MODULE.fullmatch(n)]
    for n in dropped:
        del stored[n]
    if dropped:
        log.info(
            "skipping %d tensors of multi-token prediction modules (mtp.*): pdserve does not "
            "run MTP",
            len(dropped),
        )


@dataclass(frozen=True)
class Fp8Scale:
    """One float32 scale per (rows x cols) block of an fp8 weight: w = fp8 * scale."""

    tensor: StoredTensor
    block: tuple[int, int]


def _fp8_scales(
    stored: dict[str, StoredTensor], arch: ModelArch, where: str
) -> dict[str, Fp8Scale]:
    """Take every `X.weight_scale_inv` out of `stored`: {X.weight: its scale}, each checked
    against its weight's shape; an fp8 weight without one is refused."""
    suffix = "_scale_inv"
    names = [n for n in stored if n.endswith(".weight" + suffix)]
    if names and arch.fp8_block is None:
        raise ModelConfigError(
            f"{where}: {names[0]} and {len(names) - 1} more scales, but config.json has no fp8 "
            "quantization_config with a weight_block_size"
        )
    out: dict[str, Fp8Scale] = {}
    for n in names:
        scale = stored.pop(n)
        weight = n[: -len(suffix)]
        w = stored.get(weight)
        assert arch.fp8_block is not None
        b0, b1 = arch.fp8_block
        if w is None or len(w.shape) != 2:
            raise ModelConfigError(f"{where}: scale {n} has no 2-D weight {weight}")
        want = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
        if scale.shape != want or scale.dtype != torch.float32:
            raise ModelConfigError(
                f"{where}: scale {n} is {scale.dtype} {scale.shape}; weight {weight} "
                f"{w.shape} in blocks of {arch.fp8_block} needs float32 {want}"
            )
        out[weight] = Fp8Scale(scale, arch.fp8_block)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    unscaled = sorted(n for n, t in stored.items() if t.dtype in fp8 and n not in out)
    if unscaled:
        raise ModelConfigError(
            f"{where}: fp8 tensors without a weight_scale_inv: {', '.join(unscaled[:5])}"
        )
    return out


def _read_whole(f: io.FileIO, t: StoredTensor) -> torch.Tensor:
    nbytes = math.prod(t.shape) * t.dtype.itemsize
    buf = bytearray(nbytes)
    f.seek(t.offset)
    view, got = memoryview(buf), 0
    while got < nbytes:
        k = f.readinto(view[got:])
        if not k:
            raise ModelConfigError(f"{t.file}: ends inside tensor data at byte {t.offset}")
        got += k
    return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)


def _dequantised(
    f: io.FileIO, weight: StoredTensor, sf: io.FileIO, scale: Fp8Scale
) -> torch.Tensor:
    """The fp8 weight [M, N] (in `f`) times its scale [ceil(M/b0), ceil(N/b1)] (in `sf`, maybe
    the same file) per block, float32."""
    w = _read_whole(f, weight).float()  # [M, N]
    s = _read_whole(sf, scale.tensor)  # [ceil(M / b0), ceil(N / b1)] float32
    b0, b1 = scale.block
    m, n = w.shape
    return w * s.repeat_interleave(b0, 0)[:m].repeat_interleave(b1, 1)[:, :n]
