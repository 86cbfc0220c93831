"""The KV layout descriptor: which typed buffers a paged KV pool holds, and where in a page.

A layer's KV is a set of named buffers (`BufferSpec`, kvcache/buffer_spec.py), each with its
own per-token shape and dtype, and a buffer may exist in some layers only (Llama: "k" and "v"
[kv_heads, head_dim] in every layer; DeepSeek MLA: one "latent" [1, 576]; V3.2's indexer adds
"index_k" in fp8 with a float32 "index_k_scale" beside it). A page is ONE contiguous run of
`page_bytes` bytes holding `page_size` tokens of every (layer, buffer), layer-major, each region
starting on an `ALIGN` boundary so that a typed view of it is aligned for every dtype:

    page = [layer 0: buf a | pad | buf b | pad] [layer 1: buf a | pad] ...   (page_bytes)

Everything that touches KV bytes (the pool, a host tier, a transfer backend) takes offsets and
sizes from this descriptor, never from class constants: a bf16 buffer is never moved as fp8.
Two pools exchange pages only if their descriptors agree; `mismatch` names the buffer and the
field that differ. `from_desc` reads a peer's descriptor (protocol/layout_desc.py) and
raises only ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec
import torch

from pdserve.kvcache.buffer_spec import DTYPES, MAX_LAYERS, BufferSpec, StateSpec, check_int
from pdserve.kvcache.v4_layout import V4Shape, v4_buffers, v4_page_size, v4_state
from pdserve.protocol.layout_desc import BufferDesc, LayoutDesc, StateDesc

ALIGN = 64  # bytes: every region starts on this boundary (a cache line; any dtype's alignment)
# Bounds on a descriptor, so that a peer's cannot make us compute or allocate without end (a
# buffer's own bounds are in kvcache/buffer_spec.py).
MAX_BUFFERS = 32
MAX_PAGE_SIZE = 1 << 16
MAX_TP = 1 << 16
MAX_PAGE_BYTES = 1 << 32


class LatentShape(Protocol):
    """What a latent-attention layout needs of a model (model/deepseek_config.py MLAArch has it)."""

    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...


class IndexerShape(Protocol):
    """What V3.2's index-K buffers need of a model (model/deepseek_config.py DSAArch has it)."""

    @property
    def index_head_dim(self) -> int: ...


class ModelShape(Protocol):
    """What `KVLayout.for_model` needs of a model (model/config.py ModelArch has it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def mla(self) -> LatentShape | None: ...
    @property
    def dsa(self) -> IndexerShape | None: ...
    @property
    def v4(self) -> V4Shape | None: ...


LATENT = "latent"  # MLA's one cached vector a token (model/mla.py)
INDEX_K, INDEX_K_SCALE = "index_k", "index_k_scale"  # V3.2's indexer keys (model/dsa_indexer.py)


def index_k_buffers(
    mode: str, head_dim: int, dtype: str, layers: tuple[int, ...] | None = None
) -> tuple[BufferSpec, ...]:
    """The buffers V3.2's indexer adds to its layers (`--index-k-dtype`): "auto" stores
    "index_k" [head_dim] in `dtype` (the model's: HF parity); "fp8" stores it float8_e4m3fn
    with a float32 "index_k_scale" [1] per token beside it."""
    if mode == "auto":
        return (BufferSpec(INDEX_K, (head_dim,), dtype, layers),)
    if mode == "fp8":
        return (
            BufferSpec(INDEX_K, (head_dim,), "float8_e4m3fn", layers),
            BufferSpec(INDEX_K_SCALE, (1,), "float32", layers),
        )
    raise ValueError(f"index-K dtype must be 'auto' or 'fp8', got {mode!r}")


class Region(NamedTuple):
    """Where one (layer, buffer) lives inside a page."""

    layer: int
    spec: BufferSpec
    offset: int  # bytes from the page's start, a multiple of ALIGN
    nbytes: int  # a page of it: spec.rows_per_page(page_size) * spec.token_bytes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class KVLayout:
    """A paged pool's contents: `buffers` for `page_size` tokens, in each of `num_layers`."""

    buffers: tuple[BufferSpec, ...]
    page_size: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1
    # Per-request state (kvcache/state_pool.py): not in pages, but a peer must agree on it too.
    state: tuple[StateSpec, ...] = ()
    # Derived in __post_init__: every (layer, buffer) region in page order, and the page size.
    regions: tuple[Region, ...] = field(init=False, repr=False, compare=False)
    page_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("KVLayout.page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_int("KVLayout.num_layers", self.num_layers, 1, MAX_LAYERS)
        check_int("KVLayout.tp_size", self.tp_size, 1, MAX_TP)
        check_int("KVLayout.tp_rank", self.tp_rank, 0, self.tp_size - 1)
        if not isinstance(self.buffers, tuple) or not 1 <= len(self.buffers) <= MAX_BUFFERS:
            raise ValueError(f"KVLayout.buffers must be a tuple of 1 to {MAX_BUFFERS} buffers")
        if not all(isinstance(b, BufferSpec) for b in self.buffers):
            raise ValueError("KVLayout.buffers must hold BufferSpecs")
        if not isinstance(self.state, tuple) or len(self.state) > MAX_BUFFERS:
            raise ValueError(f"KVLayout.state must be a tuple of at most {MAX_BUFFERS}")
        if not all(isinstance(s, StateSpec) for s in self.state):
            raise ValueError("KVLayout.state must hold StateSpecs")
        for st in self.state:
            if st.layers and st.layers[-1] >= self.num_layers:
                raise ValueError(
                    f"KVLayout: state {st.name!r} names layer {st.layers[-1]}, "
                    f"but there are {self.num_layers} layers"
                )
        names = [b.name for b in self.buffers] + [st.name for st in self.state]
        if len(set(names)) != len(names):
            raise ValueError(f"KVLayout.buffers: duplicate names in {names}")
        for b in self.buffers:
            if b.layers is not None and b.layers[-1] >= self.num_layers:
                raise ValueError(
                    f"KVLayout: buffer {b.name!r} names layer {b.layers[-1]}, "
                    f"but there are {self.num_layers} layers"
                )
        present = [set(self.layers_of(b.name)) for b in self.buffers]
        regions: list[Region] = []
        offset = 0
        for layer in range(self.num_layers):
            for b, layers in zip(self.buffers, present, strict=True):
                if layer in layers:
                    nbytes = b.rows_per_page(self.page_size) * b.token_bytes
                    regions.append(Region(layer, b, offset, nbytes))
                    offset = _align(offset + nbytes)
        if offset > MAX_PAGE_BYTES:
            raise ValueError(f"KVLayout: a page of {offset} bytes exceeds {MAX_PAGE_BYTES}")
        object.__setattr__(self, "regions", tuple(regions))
        object.__setattr__(self, "page_bytes", offset)

    @classmethod
    def llama(
        cls,
        dtype: str,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KVLayout:
        """The Llama family: "k" and "v", each [num_kv_heads, head_dim] of `dtype`, every layer."""
        shape = (num_kv_heads, head_dim)
        return cls(
            (BufferSpec("k", shape, dtype), BufferSpec("v", shape, dtype)),
            page_size,
            num_layers,
            tp_rank,
            tp_size,
        )

    @classmethod
    def mla(
        cls,
        dtype: str,
        page_size: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KVLayout:
        """Multi-head latent attention (DeepSeek-V3): one "latent" buffer [1, kv_lora_rank +
        qk_rope_head_dim] of `dtype` in every layer (the normed compressed KV, then the rotated
        key every head shares)."""
        latent = BufferSpec(LATENT, (1, kv_lora_rank + qk_rope_head_dim), dtype)
        return cls((latent,), page_size, num_layers, tp_rank, tp_size)

    @classmethod
    def for_model(
        cls,
        arch: ModelShape,
        dtype: str,
        page_size: int,
        index_k: str = "auto",
        kv: str = "auto",
        page_ends: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KVLayout:
        """The layout a model's attention needs: latent for MLA (`arch.mla`), plus index-K in
        `index_k`'s mode (`index_k_buffers`) where it has V3.2's indexer (`arch.dsa`);
        DeepSeek-V4's compressed entries in `kv`'s mode ("auto": the model dtype, "fp8":
        kvcache/v4_layout.py) and per-request state (`arch.v4`), in pages of whole
        compression windows (`v4_page_size`), with each page's end (`page_ends`: where a prefix
        cache may resume); else k and v. `kv` "fp8" is V4's only: other models' KV is refused
        in it. `tp_rank` of `tp_size`: a tensor-parallel rank's pool, k and v of the KV heads
        `arch` gives it (ModelArch.for_rank), or MLA's whole latent (and index-K: every
        expert-parallel rank attends alike); not DeepSeek-V4's."""
        if tp_size != 1 and arch.v4 is not None:
            raise ValueError("DeepSeek-V4's KV runs at tensor parallelism 1 only")
        if arch.v4 is not None:
            v4 = arch.v4
            size = v4_page_size(v4, page_size)
            return cls(
                v4_buffers(v4, dtype, size, kv, page_ends),
                size,
                v4.num_layers,
                state=v4_state(v4, dtype),
            )
        if kv != "auto":
            what = "MLA's latent" if arch.mla is not None else "k and v"
            raise ValueError(
                f"--kv-dtype {kv} is for DeepSeek-V4 only: this model's {what} stays in the "
                "model dtype (--kv-dtype auto)"
                + ("; for fp8 indexer keys, --index-k-dtype fp8" if arch.dsa is not None else "")
            )
        if arch.mla is None:
            return cls.llama(
                dtype,
                page_size,
                arch.num_layers,
                arch.num_kv_heads,
                arch.head_dim,
                tp_rank,
                tp_size,
            )
        m = arch.mla
        layout = cls.mla(
            dtype, page_size, arch.num_layers, m.kv_lora_rank, m.qk_rope_head_dim,
            tp_rank, tp_size,
        )  # fmt: skip
        if arch.dsa is None:
            return layout
        extra = index_k_buffers(index_k, arch.dsa.index_head_dim, dtype)
        return cls(layout.buffers + extra, page_size, arch.num_layers, tp_rank, tp_size)

    # -- where things are -------------------------------------------------------------------
    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"the KV layout has no buffer {name!r}")

    def region(self, layer: int, name: str) -> Region:
        """Where buffer `name` of `layer` lives in a page; KeyError if that layer lacks it."""
        for r in self.regions:
            if r.layer == layer and r.spec.name == name:
                return r
        raise KeyError(f"layer {layer} of the KV layout has no buffer {name!r}")

    def layers_of(self, name: str) -> tuple[int, ...]:
        b = self.buffer(name)
        return tuple(range(self.num_layers)) if b.layers is None else b.layers

    @property
    def bytes_per_page_all_layers(self) -> int:
        """The same as page_bytes (its name before layouts had typed buffers)."""
        return self.page_bytes

    # -- the Llama family's fields, for code written for one dtype and one K/V shape ----------
    @property
    def dtype(self) -> str:
        """The dtype every buffer shares; ValueError if they differ."""
        dtypes = {b.dtype for b in self.buffers}
        if len(dtypes) != 1:
            raise ValueError(f"the KV layout's buffers have several dtypes: {sorted(dtypes)}")
        return dtypes.pop()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def num_kv_heads(self) -> int:
        return self._kv_shape()[0]

    @property
    def head_dim(self) -> int:
        return self._kv_shape()[1]

    def _kv_shape(self) -> tuple[int, int]:
        k = self.buffer("k")
        if len(k.shape) != 2:
            raise ValueError(f"buffer 'k' is {k.shape} per token, not [kv_heads, head_dim]")
        return k.shape[0], k.shape[1]

    # -- comparing and shipping -------------------------------------------------------------
    def mismatch(self, other: KVLayout, ours: str = "ours", theirs: str = "theirs") -> str | None:
        """What differs, as 'field: ours vs theirs' or "buffer 'x' field: ours vs theirs"; None
        when pages can move between the two. `ours`/`theirs` name the sides in the message."""
        for name in ("page_size", "num_layers", "tp_size"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name}: {a!r} vs {b!r}"
        mine = {b.name: b for b in self.buffers}
        yours = {b.name: b for b in other.buffers}
        for name, a in mine.items():
            if name not in yours:
                return f"buffer {name!r} missing on {theirs}"
            b = yours[name]
            for f in ("dtype", "shape", "tokens_per_row"):
                if getattr(a, f) != getattr(b, f):
                    return f"buffer {name!r} {f}: {getattr(a, f)!r} vs {getattr(b, f)!r}"
            if self.layers_of(name) != other.layers_of(name):
                return f"buffer {name!r} layers: {self._show_layers(a)} vs {other._show_layers(b)}"
        for name in yours:
            if name not in mine:
                return f"buffer {name!r} missing on {ours}"
        if list(mine) != list(yours):
            return f"buffer order: {list(mine)} vs {list(yours)}"
        my_state = {st.name: st for st in self.state}
        your_state = {st.name: st for st in other.state}
        for name, sa in my_state.items():
            if name not in your_state:
                return f"state {name!r} missing on {theirs}"
            sb = your_state[name]
            for f in ("dtype", "shape", "layers"):
                if getattr(sa, f) != getattr(sb, f):
                    return f"state {name!r} {f}: {getattr(sa, f)!r} vs {getattr(sb, f)!r}"
        for name in your_state:
            if name not in my_state:
                return f"state {name!r} missing on {ours}"
        if list(my_state) != list(your_state):
            return f"state order: {list(my_state)} vs {list(your_state)}"
        if self.page_bytes != other.page_bytes:  # the same buffers placed differently
            return f"page_bytes: {self.page_bytes} vs {other.page_bytes}"
        return None

    def _show_layers(self, b: BufferSpec) -> str:
        return "all" if len(self.layers_of(b.name)) == self.num_layers else repr(b.layers)

    def to_desc(self) -> LayoutDesc:
        """The wire form (protocol/layout_desc.py)."""
        bufs = tuple(
            BufferDesc(b.name, b.shape, b.dtype, b.layers, b.tokens_per_row) for b in self.buffers
        )
        state = tuple(StateDesc(st.name, st.shape, st.dtype, st.layers) for st in self.state)
        return LayoutDesc(bufs, self.page_size, self.num_layers, self.tp_rank, self.tp_size, state)

    def to_dict(self) -> dict[str, object]:
        """The JSON form (/info, /debug): the wire form's builtins."""
        d: dict[str, object] = msgspec.to_builtins(self.to_desc())
        return d

    @classmethod
    def from_desc(cls, desc: LayoutDesc) -> KVLayout:
        """A peer's descriptor, its types checked by the decoder: every range checked here;
        ValueError, never anything else, if it is not a valid layout."""
        if len(desc.buffers) > MAX_BUFFERS or len(desc.state) > MAX_BUFFERS:
            raise ValueError(f"KVLayout: buffers and state are lists of at most {MAX_BUFFERS}")
        try:
            buffers = tuple(
                BufferSpec(b.name, b.shape, b.dtype, b.layers, b.tokens_per_row)
                for b in desc.buffers
            )
            state = tuple(StateSpec(st.name, st.shape, st.dtype, st.layers) for st in desc.state)
        except ValueError as e:
            raise ValueError(f"KVLayout: {e}") from None
        return cls(buffers, desc.page_size, desc.num_layers, desc.tp_rank, desc.tp_size, state)

    @classmethod
    def from_dict(cls, d: object) -> KVLayout:
        """The JSON form back (a peer's /info): ValueError, never anything else."""
        try:
            desc = msgspec.convert(d, LayoutDesc)
        except (msgspec.ValidationError, UnicodeEncodeError) as e:
            raise ValueError(f"KVLayout: {e}") from None
        return cls.from_desc(desc)
