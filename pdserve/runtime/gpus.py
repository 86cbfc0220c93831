"""Which GPUs `pdserve launch` spreads its workers over (`--gpus`).

`auto` (the default): when the workers run on CUDA (`--device cuda` or `auto` on a machine with
a GPU) and this process sees more than one GPU, every GPU it sees: the entries of its
CUDA_VISIBLE_DEVICES when that is set (as many as torch counts), else 0..N-1. One GPU, the
CPU, or an explicit `--device cuda:N`: no placement, every worker sees what the launcher sees
(as before). `none`: no placement. A list (`0,1` or GPU UUIDs / MIG ids): exactly those, in
that order; it needs the workers on CUDA and GPUs the launcher itself sees (entries of its
CUDA_VISIBLE_DEVICES when set, else indices below the device count). The launcher
(runtime/launcher.py) hands worker i the entry i mod N as its CUDA_VISIBLE_DEVICES, so a
worker's `cuda` is its own GPU; `launch` then passes `--device cuda` (not `auto`) to placed
workers, so a GPU a worker cannot open fails its start instead of leaving it on the CPU.
`pdserve serve --device cuda:N` pins its own process the same way (`pin_to_device`).
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

# A CUDA_VISIBLE_DEVICES entry: an index, a GPU UUID (GPU-…) or a MIG id (MIG-…).
_ENTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9:/_-]*")


def _entries(spec: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in spec.split(",") if x.strip())


def resolve_gpus(spec: str, device: str, visible: str | None, device_count: int) -> tuple[str, ...]:
    """The CUDA_VISIBLE_DEVICES entries to spread the workers over (empty: no placement).
    `device`: the workers' --device; `visible`: this process's CUDA_VISIBLE_DEVICES (None if
    unset); `device_count`: the GPUs torch sees here (0 without CUDA). Raises ValueError for
    a list that cannot be honoured."""
    spec = spec.strip()
    if spec in ("auto", "none"):
        if spec == "none" or device not in ("cuda", "auto") or device_count < 2:
            return ()
        seen = _entries(visible)[:device_count] if visible is not None else ()
        gpus = seen if seen else tuple(str(i) for i in range(device_count))
        return gpus if len(gpus) > 1 else ()
    gpus = _entries(spec)
    bad = [g for g in gpus if not _ENTRY.fullmatch(g)]
    if not gpus or bad:
        raise ValueError(f"--gpus {spec!r}: want auto, none or a comma list of GPU ids")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {spec!r} names a GPU twice")
    if device not in ("cuda", "auto") or device_count == 0:
        raise ValueError(
            f"--gpus {spec!r} places workers on GPUs: it needs --device cuda (or auto on a "
            f"machine with a GPU), got --device {device}"
            + ("" if device_count else " and no GPU visible")
        )
    if visible is not None:
        seen = _entries(visible)[:device_count]
        unseen = [g for g in gpus if g not in seen]
        where = f"CUDA_VISIBLE_DEVICES={visible}"
    else:
        unseen = [g for g in gpus if g.isdigit() and int(g) >= device_count]
        where = f"{device_count} GPUs"
    if unseen:
        raise ValueError(f"--gpus {spec!r}: {', '.join(unseen)} not among this host's ({where})")
    return gpus


def pin_to_device(device: str, environ: MutableMapping[str, str]) -> str:
    """`--device cuda:N` for one process (`pdserve serve`): the process is given only that GPU
    through CUDA_VISIBLE_DEVICES (the N-th entry of the one it has, if any) and uses it as
    `cuda`. Every CUDA call then lands on it, Triton's launches and graph captures included,
    which follow the thread's current device (device 0) rather than a tensor's. Must run
    before CUDA starts in this process; other devices are returned unchanged."""
    m = re.fullmatch(r"cuda:(\d+)", device)
    if m is None:
        return device
    n = int(m.group(1))
    if "CUDA_VISIBLE_DEVICES" in environ:
        seen = _entries(environ["CUDA_VISIBLE_DEVICES"])
        if n >= len(seen):
            raise ValueError(
                f"--device {device}: CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} "
                f"gives this process {len(seen)} GPU(s)"
            )
        environ["CUDA_VISIBLE_DEVICES"] = seen[n]
    else:
        environ["CUDA_VISIBLE_DEVICES"] = str(n)
    return "cuda"
