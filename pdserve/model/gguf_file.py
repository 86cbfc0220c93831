"""A GGUF file (llama.cpp's one-file checkpoint) seen as an HF checkpoint: its config and tensors.

A .gguf holds metadata under llama.cpp's key names (`llama.embedding_length`, ...; the
tokenizer's `tokenizer.ggml.*` are read by model/gguf_tokenizer.py) and every tensor under
llama.cpp's names (`blk.0.attn_q.weight`), quantised or not. Here:
  * `hf_config()`: the metadata as an HF config.json dict, which ModelArch parses like any
    other (so the same refusals apply);
  * `shapes()` and `read(name)`: the tensors under their HF names, in HF's layout; a tensor is
    dequantised to a float32 array when read (`gguf.quants.dequantize`: F32, F16, BF16, Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, ...), from a plain file read, never through the
    reader's memory map (its touched pages would stay in the process's RSS; model/loader.py
    says why).
No torch here: the router reads a GGUF's tokenizer (model/gguf_tokenizer.py) and loads no torch.
What llama.cpp's converter changed, and `read` undoes:
  * in a Llama file (general.architecture "llama": Llama, Mistral, SmolLM) the rows of each q
    and k head are permuted: HF's rotary halves [x_0 .. x_(D/2-1) | y_0 .. y_(D/2-1)] are stored
    as the pairs (x_0, y_0, x_1, y_1, ...) that llama.cpp's RoPE rotates. Qwen2 files are not
    permuted (llama.cpp rotates their halves, as HF does);
  * a tied output projection is not stored (`tie_word_embeddings` is its absence);
  * Llama 3's RoPE scaling is stored as divisors of the rotary frequencies (`rope_freqs.weight`),
    not as config: `rope_freq_divisors()`.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
from gguf.quants import dequantize

from pdserve.model.errors import ModelConfigError

SUFFIX = ".gguf"
# general.architecture -> the HF architecture that serves it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_QK = {"llama"}  # files whose q/k rows llama.cpp's converter permuted
# general.file_type -> the dtype "auto" picks: a float file's own; a quantised one's values are
# exact in float32 (pass --dtype bfloat16 to halve the memory).
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
_SPLIT_NAME = re.compile(r".*-\d{5}-of-\d{5}\.gguf")
_ROPE_DIVISORS = "rope_freqs.weight"

# llama.cpp's tensor names -> HF's (full match, `re.sub` templates).
_HF_NAMES = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)", r"model.layers.\1.mlp.\2_proj.\3"),
)
_Q_OR_K = re.compile(r"model\.layers\.\d+\.self_attn\.(q|k)_proj\.(weight|bias)")


def find_gguf(path: Path) -> Path | None:
    """The GGUF checkpoint `path` names: a .gguf file, or the one .gguf in a directory without
    config.json; None for anything else (an HF directory). Refused: a directory holding several
    .gguf files (which one is meant?) and the shards of a split file."""
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(path.glob(f"*{SUFFIX}"))
        if len(found) > 1:
            raise ModelConfigError(
                f"{path} holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                "pass --model the one to serve"
            )
        path = found[0] if found else path
    if not (path.is_file() and path.suffix == SUFFIX):
        return None
    if _SPLIT_NAME.fullmatch(path.name):
        raise ModelConfigError(
            f"{path} is one shard of a split GGUF; pdserve reads single files (merge the shards "
            "with llama.cpp's `llama-gguf-split --merge`)"
        )
    return path


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, shared within the process while it is unchanged: parsing the metadata
    costs seconds (every vocabulary string), and the config, the tokenizer and the loader each
    need it."""
    st = path.stat()
    return _open(path.resolve(), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


class StoredTensor(NamedTuple):
    """Where one tensor's bytes are and how they are laid out."""

    gguf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # HF's: [out, in] for a projection
    offset: int  # absolute, in the file
    raw_shape: tuple[int, ...]  # the stored array: [rows, bytes per row] when quantised
    raw_dtype: np.dtype[Any]


class GGUFFile:
    """One parsed .gguf: metadata values by key, tensors by HF name. Immutable; holds no open
    file or mapping (the reader's map is dropped once the header is parsed)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            reader = GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as e:  # bad magic, truncated, bad types
            raise ModelConfigError(f"{self.path}: not a readable GGUF file: {e}") from e
        self._meta: dict[str, Any] = {k: _value(f, self.path) for k, f in reader.fields.items()}
        self.architecture = str(self._meta.get("general.architecture", ""))
        self._tensors = {
            _hf_name(t.name): StoredTensor(
                t.name,
                GGMLQuantizationType(t.tensor_type),
                tuple(int(d) for d in reversed(t.shape.tolist())),
                int(t.data_offset),
                tuple(t.data.shape),
                t.data.dtype,
            )
            for t in reader.tensors
        }
        self._config: dict[str, Any] | None = None

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (a list for an array), or `default` if absent."""
        return self._meta.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._meta:
            raise ModelConfigError(f"{self.path}: required metadata {key!r} is missing")
        return self.get(key)

    def hf_config(self) -> dict[str, Any]:
        """The metadata as an HF config.json dict (HF's field names); derived once, since the
        file is immutable and `read` asks for the head counts of every q and k tensor."""
        if self._config is None:
            self._config = self._derive_config()
        return dict(self._config)

    def _derive_config(self) -> dict[str, Any]:
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise ModelConfigError(
                f"{self.path}: general.architecture {arch!r} is not supported; supported: "
                f"{sorted(ARCHITECTURES)} (Mistral and SmolLM files are 'llama')"
            )
        heads = int(self.require(f"{arch}.attention.head_count"))
        kv_heads = self.get(f"{arch}.attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per layer: only uniform attention is served
            if len(set(kv_heads)) != 1:
                raise ModelConfigError(f"{self.path}: per-layer kv head counts {kv_heads}")
            kv_heads = kv_heads[0]
        hidden = int(self.require(f"{arch}.embedding_length"))
        head_dim = int(self.get(f"{arch}.attention.key_length", hidden // heads))
        rotary = self.get(f"{arch}.rope.dimension_count", head_dim)
        if int(rotary) != head_dim:
            raise ModelConfigError(
                f"{self.path}: rope.dimension_count {rotary} != head dim {head_dim}: "
                "partial rotary embeddings are not supported"
            )
        if "model.embed_tokens.weight" not in self._tensors:
            raise ModelConfigError(f"{self.path}: no token_embd.weight tensor")
        names = self._tensors.keys()
        file_type = self.get("general.file_type")
        return {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": self._tensors["model.embed_tokens.weight"].shape[0],
            "hidden_size": hidden,
            "intermediate_size": int(self.require(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(self.require(f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self.require(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.get(f"{arch}.rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(arch),
            "max_position_embeddings": int(self.require(f"{arch}.context_length")),
            "tie_word_embeddings": "lm_head.weight" not in names,
            "attention_bias": "model.layers.0.self_attn.o_proj.bias" in names,
            "mlp_bias": "model.layers.0.mlp.up_proj.bias" in names,
            "hidden_act": "silu",
            "torch_dtype": _FILE_DTYPES.get(file_type, "float32"),
        }

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        kind = self.get(f"{arch}.rope.scaling.type", "none")
        if kind == "none":
            return None
        # HF's fields; a type pdserve does not run (yarn, ...) reaches ModelArch's refusal.
        out = {"rope_type": kind, "factor": float(self.get(f"{arch}.rope.scaling.factor", 1.0))}
        original = self.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        return out

    # ------------------------------------------------------------------------------ tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every model tensor's HF name and HF shape; what llama.cpp adds (`rope_freqs.weight`)
        is not a model tensor."""
        return {n: t.shape for n, t in self._tensors.items() if n != _ROPE_DIVISORS}

    def stored_types(self) -> dict[str, int]:
        """How the tensors are stored: {type name (F32, Q4_1, ...): count}."""
        return dict(Counter(t.qtype.name for t in self._tensors.values()))

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` (an HF name from shapes()) dequantised to float32, in HF's layout."""
        t = self._tensors[name]
        raw = np.empty(t.raw_shape, dtype=t.raw_dtype)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(t.offset)
            view, got = raw.reshape(-1).view(np.uint8).data, 0
            while got < len(view):
                k = f.readinto(view[got:])
                if not k:
                    raise ModelConfigError(f"{self.path}: ends inside tensor {t.gguf_name}")
                got += k
        try:
            values = dequantize(raw, t.qtype)
        except NotImplementedError as e:
            raise ModelConfigError(
                f"{self.path}: tensor {t.gguf_name} is {t.qtype.name}, which the gguf package "
                f"cannot dequantise ({e})"
            ) from e
        out = np.ascontiguousarray(values, dtype=np.float32).reshape(t.shape)
        m = _Q_OR_K.fullmatch(name)
        if m is not None and self.architecture in _PERMUTED_QK:
            cfg = self.hf_config()  # kv heads checked there (one count, or uniform per layer)
            heads = cfg["num_key_value_heads" if m.group(1) == "k" else "num_attention_heads"]
            out = _unpermute_rope_rows(out, int(heads))
        return out

    def rope_freq_divisors(self) -> np.ndarray | None:
        """[head_dim / 2] float32 divisors of the rotary frequencies, as llama.cpp applies
        `rope_freqs.weight` (its converter's form of Llama 3's rope scaling); None if absent."""
        if _ROPE_DIVISORS not in self._tensors:
            return None
        divisors = self.read(_ROPE_DIVISORS)
        want = (self.hf_config()["head_dim"] // 2,)
        if divisors.shape != want:
            raise ModelConfigError(
                f"{self.path}: rope_freqs.weight has shape {divisors.shape}, want {want} "
                "(head_dim / 2)"
            )
        return divisors


def _hf_name(gguf_name: str) -> str:
    """HF's name of a llama.cpp tensor; an unknown name stays as it is (and the weight plan
    refuses it, naming it)."""
    for pattern, template in _HF_NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, template, gguf_name)
    return gguf_name


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. w: [heads * D, ...] (a weight or a bias) whose
    rows, per head, are stored as [D/2, 2] (pair i = HF rows i and D/2 + i); HF's are [2, D/2]."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _value(field: ReaderField, where: Path) -> Any:
    """A metadata field's value: scalar, string, or a list of either (an array)."""
    parts = [field.parts[i] for i in field.data]
    if field.types[-1] == GGUFValueType.STRING:
        try:
            values: list[Any] = [bytes(p).decode("utf-8") for p in parts]
        except UnicodeDecodeError as e:
            raise ModelConfigError(f"{where}: metadata {field.name} is not UTF-8: {e}") from e
    else:
        values = [v for p in parts for v in p.tolist()]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]
