"""Load an HF checkpoint directory (single or sharded safetensors) into a CausalLM; or a GGUF
file, whose tensors model/gguf_file.py reads in HF's names and layout, dequantised.

Peak memory is the model in its final dtype plus one read chunk (CHUNK_BYTES):
  * the model is built on the meta device and each parameter is then created empty, in the
    target dtype, on the target device; tied parameters are tied first, so they get one tensor;
  * weight_map.plan() pairs checkpoint tensors with parameters and checks every name and shape
    before a byte is read (model/safetensors_file.py reads the files' headers);
  * each tensor is read from its file in chunks into one reused buffer and copied (cast on the
    way) into its destination.
We read the files with plain reads rather than safetensors' safe_open: safe_open maps the whole
file, and every page a tensor touches stays resident, counted in the process's RSS, until the
handle closes: about 600 MiB over the model for qwen2-0.5b-shape's first shard (see
benchmarks/models/load_memory.py).

Also (DeepSeek checkpoints; V3.2's indexer weights load by name, its weights_proj kept float32
like the router's): block-quantised weights (V3's fp8 with float32 `weight_scale_inv`; V4's fp8
with E8M0 `scale`s and its fp4 routed experts) are paired with their scales and checked by
model/quantized.py before a byte is read, then dequantised one tensor at a time (fp4 planned at
its unpacked shape), or, for the weights model/fp8_weights.py keeps fp8 (`quantization`, decided
on the meta model before anything is allocated), copied as stored beside their scales; the
weights of multi-token prediction layers (the `num_nextn_predict_layers` layers after the last;
DeepSeek-V4's `mtp.*` modules) are skipped with one log line, as vLLM does: pdserve does not
run MTP, and the model without them is the whole model. DeepSeek-V4's hash-routing tables
(tid2eid) load as integers.

Tensor parallelism (`group` of N ranks, the Llama family): each rank builds its shard of the
model (model/llama.py) and plans the checkpoint against the whole model's shapes
(`Sharded.whole_shape`, parallel/layers.py), so the plan and its checks are the TP-1 plan; a
sharded parameter's tensors are then read whole, one at a time, and the layer copies its rank's
rows (`Sharded.load_shard`: q, k and v each their own slice of the fused qkv_proj).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import TypeAlias

import torch
from torch import nn

from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdserve.model.deepseek_v32 import DeepseekV32ForCausalLM
from pdserve.model.fp8_weights import Fp8Plan, is_fp8_param, keep_fp8, keeps_fp8, plan_fp8
from pdserve.model.gguf_file import GGUFFile, find_gguf, open_gguf
from pdserve.model.llama import CausalLM, rope_inv_freq
from pdserve.model.quant_config import ScaleFormat
from pdserve.model.quantized import BlockScale, dequantize, e8m0_values, take_scales
from pdserve.model.safetensors_file import (
    OpenFiles,
    StoredTensor,
    checkpoint_tensors,
    copy_tensor,
    read_whole,
    weight_files,
)
from pdserve.model.weight_map import Index, IndexSlice, Placement, Slice, Whole, plan, rules_for
from pdserve.parallel.group import RankGroup
from pdserve.parallel.layers import Sharded

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHUNK_BYTES = 16 << 20
Fp8Scale = BlockScale  # a weight's scale, as copy_placements takes it (the name tests use)


LoadedModel: TypeAlias = CausalLM | DeepseekV3ForCausalLM | DeepseekV4ForCausalLM
# A tensor-parallel parameter's name -> its layer and the parameter's name there.
Shards: TypeAlias = dict[str, tuple[Sharded, str]]


def empty_model(
    arch: ModelArch, dtype: torch.dtype, device: torch.device, group: RankGroup | None = None
) -> LoadedModel:
    """The model with uninitialised parameters, each allocated once in `dtype` on `device`
    (tied parameters share one tensor; the model's FLOAT32_PARAMS in float32), and its derived
    buffers computed. `group`: this rank's tensor-parallel group (default: TP 1): the model
    holds its shard (Llama by head, DeepSeek-V3/V3.2 by expert: ModelArch.for_rank)."""
    return allocate(meta_model(arch, dtype, group), dtype, device)


def meta_model(arch: ModelArch, dtype: torch.dtype, group: RankGroup | None = None) -> LoadedModel:
    """The model on the meta device (shapes only), its tied parameters tied."""
    if arch.v4 is not None and dtype == torch.float16:
        # HF keeps V4's compressor and indexer projections in float32 under float16.
        raise ModelConfigError(f"{arch.architecture} runs in float32 or bfloat16, not float16")
    group = group or RankGroup.single()
    arch.for_rank(group.world_size, group.rank)  # refuses what does not split, by field name
    with torch.device("meta"):
        model: LoadedModel = (
            DeepseekV4ForCausalLM(arch)
            if arch.v4 is not None
            else CausalLM(arch, group)
            if arch.family != "deepseek_v3"
            else DeepseekV32ForCausalLM(arch, group)
            if arch.dsa is not None
            else DeepseekV3ForCausalLM(arch, group)
        )
    model.tie_weights()
    return model


def allocate(model: LoadedModel, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Give a meta model's parameters storage on `device`: `dtype`, but float32 for its
    FLOAT32_PARAMS, and their own type for integer tables and for parameters made fp8
    (model/fp8_weights.py: the weight and its float32 scales); then its derived buffers."""
    keep32 = getattr(model, "FLOAT32_PARAMS", ())
    # Module.to_empty would untie (one new tensor per module), so replace parameters here.
    made: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            want = torch.float32 if name.endswith(keep32) and keep32 else dtype
            if not p.dtype.is_floating_point or is_fp8_param(name, p):
                want = p.dtype
            data = torch.empty(p.shape, dtype=want, device=device)
            made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, made[id(p)])
    # Derived buffers, never in a checkpoint. The RoPE table stays float32 like the reference.
    if isinstance(model, CausalLM):
        model.inv_freq = rope_inv_freq(model.arch.head_dim, model.arch.rope_theta,
                                       model.arch.rope_scaling)  # fmt: skip
        model.inv_freq = model.inv_freq.to(device)
    else:
        model.derive_buffers(device)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"the loader does not compute buffers {left} of {type(model).__name__}")
    return model


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    group: RankGroup | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """An HF directory's model, or a GGUF file's (a .gguf, or a directory holding one).
    `group`: this rank's tensor-parallel group: the model is its shard (default: TP 1).
    `quantization` (model/fp8_weights.py): whether a block-quantised checkpoint's fp8 weights
    stay fp8 ("auto", "fp8") or are dequantised ("none")."""
    gguf = find_gguf(path)
    if gguf is not None:
        return _load_gguf(open_gguf(gguf), dtype, device, group)
    arch = ModelArch.from_dir(path)
    stored = checkpoint_tensors(weight_files(path))
    _skip_mtp_layers(stored, arch)
    if arch.v4 is not None:
        _skip_mtp_modules(stored)
    scales = take_scales(stored, arch.quant, str(path))
    model = meta_model(arch, dtype, group)  # planned (and made fp8) before a byte is allocated
    shapes = {n: t.shape for n, t in stored.items()}
    packed: dict[str, str] = {}  # fp4 is planned at its dequantised shape: two values a byte
    for n, s in scales.items():
        shapes[n] = s.weight_shape(stored[n].shape)
        if shapes[n] != stored[n].shape:
            packed[n] = f"{s.fmt.value} stored as {stored[n].dtype} {stored[n].shape}"
    placements, _ = _plan(model, shapes, arch, str(path), packed)
    fp8 = None
    if group is not None and group.world_size > 1 and quantization != "none":
        if quantization == "fp8":  # (auto: dequantised)
            raise ModelConfigError(
                f"{path}: fp8 weights stay fp8 at tensor parallelism 1 only: "
                "--quantization none or auto dequantises them"
            )
        log.info("%s: fp8 weights dequantised: they stay fp8 at tensor parallelism 1 only", path)
        quantization = "none"
    if keeps_fp8(quantization, arch, device, str(path)) and arch.quant is not None:
        fp8 = plan_fp8(model, placements, scales, quantization, str(path))
        keep_fp8(model, fp8.kept, arch.quant.scale_fmt is ScaleFormat.UE8M0)
    model = allocate(model, dtype, device)
    params = dict(model.named_parameters())
    copy_placements(stored, placements, params, scales, _shards(model), fp8)
    model.eval()
    kept = f", {len(fp8.kept)} weights kept fp8" if fp8 is not None else ""
    log.info(
        "loaded %s (%s) from %s on %s as %s%s%s",
        arch.architecture,
        arch.family,
        path,
        device,
        dtype,
        kept,
        _rank_note(group),
    )
    return model


def _rank_note(group: RankGroup | None) -> str:
    """`, tensor-parallel rank r of N` in a load's log line (nothing at TP 1)."""
    if group is None or group.world_size == 1:
        return ""
    return f", tensor-parallel rank {group.rank} of {group.world_size}"


def _shards(model: nn.Module) -> Shards:
    """Every parameter a tensor-parallel layer holds a shard of (none at TP 1)."""
    out: Shards = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Sharded):
            for name in module.shards:
                out[f"{prefix}.{name}" if prefix else name] = (module, name)
    return out


def _ours(p: Placement, shards: Shards) -> bool:
    """Whether this rank loads placement `p`: not a row of a sharded stack it does not hold."""
    if p.target not in shards or not isinstance(p.region, Index | IndexSlice):
        return True
    layer, name = shards[p.target]
    return p.region.dim != 0 or layer.holds_index(name, p.region.index)


def _fill(
    p: Placement, value: torch.Tensor, params: dict[str, nn.Parameter], shards: Shards
) -> None:
    """Copy checkpoint tensor `value` to placement `p`'s destination, or, for a sharded
    parameter, this rank's part of it (the placement's rows of the whole parameter)."""
    if p.target not in shards:
        p.destination(params[p.target]).copy_(value)
        return
    layer, name = shards[p.target]
    match p.region:
        case Whole():
            layer.load_shard(name, value)
        case Slice(0, start, _):
            layer.load_shard(name, value, start)
        case Index(0, index):  # one expert of a stack (expert parallel): its rank's
            layer.load_index(name, value, index)
        case IndexSlice(0, index, dim, start, length):
            layer.load_index(name, value, index, (dim, start, length))
        case _:
            raise ModelConfigError(
                f"{p.source}: tensor parallelism shards whole tensors or rows of fused ones, "
                f"not {p.region} of {p.target}"
            )


def _plan(
    model: LoadedModel,
    shapes: dict[str, tuple[int, ...]],
    arch: ModelArch,
    where: str,
    stored_as: dict[str, str] | None = None,
) -> tuple[list[Placement], dict[str, nn.Parameter]]:
    """weight_map.plan() for `model`'s parameters (one name per tensor: a tied lm_head is an
    alias, not a parameter), and the parameters by name."""
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    shards = _shards(model)  # planned at the whole model's shapes: the checkpoint's
    targets = {
        name: shards[name][0].whole_shape(shards[name][1]) if name in shards else tuple(p.shape)
        for name, p in params.items()
    }
    rules = rules_for(arch.architecture)
    return plan(shapes, targets, rules, aliases, where=where, stored_as=stored_as), params


def _load_gguf(
    file: GGUFFile, dtype: torch.dtype, device: torch.device, group: RankGroup | None
) -> LoadedModel:
    """A GGUF file's tensors (model/gguf_file.py: HF names and layout, dequantised to float32
    one at a time) placed by the same plan as a directory's, and its rotary frequencies."""
    arch = ModelArch.from_hf_config(file.hf_config(), where=str(file.path))
    model = empty_model(arch, dtype, device, group)
    placements, params = _plan(model, file.shapes(), arch, str(file.path))
    shards = _shards(model)
    with torch.no_grad():
        for p in placements:
            _fill(p, torch.from_numpy(file.read(p.source)), params, shards)
    divisors = file.rope_freq_divisors()  # [head_dim / 2]: Llama 3's rope scaling, llama.cpp's way
    if divisors is not None and isinstance(model, CausalLM):
        model.inv_freq = model.inv_freq / torch.from_numpy(divisors).to(model.inv_freq.device)
    model.eval()
    log.info("loaded %s from %s (%s) on %s as %s%s", arch.architecture, file.path,
             file.stored_types(), device, dtype, _rank_note(group))  # fmt: skip
    return model


def copy_placements(
    stored: dict[str, StoredTensor],
    placements: list[Placement],
    params: dict[str, nn.Parameter],
    scales: dict[str, BlockScale] | None = None,
    shards: Shards | None = None,
    fp8: Fp8Plan | None = None,
) -> None:
    """Fill each placement's destination from its file, file by file, in offset order; a
    source with a scale (`scales`: model/quantized.py) is dequantised on the way, unless its
    parameter is kept fp8 (`fp8`): then it is copied as stored, its scale placed beside it.
    Each file is opened once (its scales may sit in another shard) and closed after its last
    read. A
    parameter in `shards` (tensor parallelism) takes its rank's part of each tensor, read
    whole."""
    scales = scales or {}
    shards = shards or {}
    # An expert another expert-parallel rank holds is not read at all.
    placements = [p for p in placements if _ours(p, shards)]
    by_file: dict[Path, list[Placement]] = defaultdict(list)
    for p in placements:
        by_file[stored[p.source].file].append(p)
    reads = [stored[p.source].file for p in placements]
    reads += [scales[p.source].tensor.file for p in placements if p.source in scales]
    bounce = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    with torch.no_grad(), OpenFiles(reads) as files:
        for file, group in sorted(by_file.items()):
            for p in sorted(group, key=lambda p: stored[p.source].offset):
                t = stored[p.source]
                if fp8 is not None and p.target in fp8.kept:
                    scale = scales[p.source]
                    dst = p.destination(params[p.target])
                    bounce = copy_tensor(files.get(file), t, dst, bounce)
                    s = read_whole(files.get(scale.tensor.file), scale.tensor)
                    s = s if s.dtype == torch.float32 else e8m0_values(s, p.source)
                    to = fp8.scales[p.source]  # the scale's own placement
                    to.destination(params[to.target]).copy_(s)
                    files.done(scale.tensor.file)
                elif p.source in scales:
                    scale = scales[p.source]
                    w = read_whole(files.get(file), t)
                    s = read_whole(files.get(scale.tensor.file), scale.tensor)
                    _fill(p, dequantize(w, s, scale, p.source), params, shards)
                    files.done(scale.tensor.file)
                elif p.target in shards:
                    _fill(p, read_whole(files.get(file), t), params, shards)
                else:
                    dst = p.destination(params[p.target])
                    bounce = copy_tensor(files.get(file), t, dst, bounce)
                files.done(file)


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
