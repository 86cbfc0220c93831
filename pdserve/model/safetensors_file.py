"""Safetensors checkpoint files: which files hold the weights, and where each tensor's bytes are.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape,
data_offsets per tensor) and the raw little-endian bytes of each tensor in C order. The
headers are read here, and the bytes with plain reads (`read_whole`, `copy_tensor` in chunks,
`OpenFiles` keeping each file open only while reads remain; model/loader.py's docstring says
why not safe_open). Two dtypes are not one byte per element of the header's shape:
  * F8_E8M0: one byte per element, an exponent (float8_e8m0fnu: 2^(byte - 127));
  * F4: e2m1 values packed two to a byte; the header's shape counts values, a StoredTensor's
    counts bytes (torch's float4_e2m1fn_x2, as safetensors loads it): the last dim halved.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.errors import ModelConfigError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
PACKED_PAIRS = "F4"  # the one dtype that stores two header elements per byte
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


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
    """Where a checkpoint tensor's bytes are: `offset` is absolute within `file`; `shape` is
    in elements of `dtype` (bytes, for F4's float4_e2m1fn_x2)."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


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
        if code == PACKED_PAIRS:
            if not shape or shape[-1] % 2:
                raise ModelConfigError(
                    f"{file.name}: tensor {name} is F4 of shape {shape}: two values a byte "
                    "need an even last dim"
                )
            shape = (*shape[:-1], shape[-1] // 2)
        t = StoredTensor(file, 8 + n + begin, SAFETENSORS_DTYPES[code], shape)
        if end - begin != t.nbytes or begin < 0 or 8 + n + end > size:
            raise ModelConfigError(
                f"{file.name}: tensor {name} ({code}, shape {entry['shape']}) has byte range "
                f"[{begin}, {end}) that does not fit its shape or the {size}-byte file"
            )
        out[name] = t
    return out


def checkpoint_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    out: dict[str, StoredTensor] = {}
    for f in files:
        for name, t in read_header(f).items():
            if name in out:
                raise ModelConfigError(f"tensor {name} is in both {out[name].file} and {f}")
            out[name] = t
    return out


def read_whole(f: io.FileIO, t: StoredTensor) -> torch.Tensor:
    """All of `t`'s bytes from its open file, as a CPU tensor of its dtype and shape."""
    buf = bytearray(t.nbytes)
    f.seek(t.offset)
    view, got = memoryview(buf), 0
    while got < t.nbytes:
        k = f.readinto(view[got:])
        if not k:
            raise ModelConfigError(f"{t.file}: ends inside tensor data at byte {t.offset}")
        got += k
    return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)


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


def copy_tensor(
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
