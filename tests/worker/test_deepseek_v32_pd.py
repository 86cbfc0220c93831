"""DeepSeek-V3.2 through PD (a prefill and a decode role in one process, KV over shm) and the
host tier: index-K travels in the pages by the layout in both storage modes; a decode worker
whose index-K mode differs is refused, naming the buffer and the field; and the incident's
regression (bf16 index-K moved as if it were fp8 corrupted tool calls under load): 32
concurrent requests with aborts, every page D decodes from byte-equal, index-K and latent,
to what P sent for that very room; and index-K pages come back byte-exact from the host tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelSpec, RunnerConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.host_pool import HostPool
from pdserve.kvcache.layout import KVLayout
from pdserve.model.config import ModelArch
from pdserve.protocol.rooms import Cmd
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.dataplane import ShmWriter
from tests.worker.wire import Wire, ended, tokens

PAGE, CHUNK = 4, 12
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
INDEX = ("index_k", "index_k_scale")


@pytest.fixture(scope="module")
def ds_dir(builtin_dir) -> Path:
    return builtin_dir("deepseek-v32-tiny")


def prompts(n: int, seed: int, lo: int = 5, hi: int = 42) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 4000, (k,), generator=g).tolist() for k in lengths]


def regions(layout: KVLayout, page: torch.Tensor, names: tuple[str, ...]) -> list[bytes]:
    """The page's bytes of these buffers, layer by layer, where `layout` puts them."""
    return [
        bytes(page[r.offset : r.offset + r.nbytes].numpy())
        for r in layout.regions
        if r.spec.name in names
    ]


@pytest.mark.parametrize("mode", ["auto", "fp8"])
def test_pd_equals_colocated(ds_dir, mode) -> None:
    ps = prompts(2, seed=1, lo=13, hi=30)  # past index_topk, prefilled in chunks of 12
    want = generate(
        build_engine(ds_dir, page_size=PAGE, max_batched_tokens=CHUNK, index_k_dtype=mode),
        ps,
        GREEDY,
    )
    wire = Wire(ds_dir, page_size=PAGE, chunk=CHUNK, index_k=(mode, mode))
    assert {b.name for b in wire.d.pool.layout.buffers} >= {"latent", "index_k"}
    outs = [wire.submit(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    wire.run_until(lambda: all(ended(o) for o in outs))
    assert [tokens(o) for o in outs] == want
    wire.run_until(wire.idle)
    assert wire.violations() == []


@pytest.mark.parametrize(
    ("p_mode", "d_mode", "why"),
    [
        ("auto", "fp8", "buffer 'index_k' dtype: 'float32' vs 'float8_e4m3fn' (prefill vs decode)"),
        ("fp8", "auto", "buffer 'index_k' dtype: 'float8_e4m3fn' vs 'float32' (prefill vs decode)"),
    ],
)
def test_a_decode_worker_of_another_index_k_mode_is_refused(ds_dir, p_mode, d_mode, why) -> None:
    wire = Wire(ds_dir, page_size=PAGE, chunk=CHUNK, index_k=(p_mode, d_mode))
    out = wire.submit("r", prompts(1, seed=2)[0], GREEDY)
    wire.run_until(lambda: ended(out))
    assert out[-1].finish_reason == "error" and why in (out[-1].error or "")
    assert [w for _, _, w in wire.p_role.refusals] == [f"KV layout mismatch, {why}"]
    assert wire.p_role.by_room == {} and tokens(out) == []
    wire.run_until(wire.idle)


def test_incident_bf16_index_k_under_load_with_aborts(ds_dir, monkeypatch) -> None:
    """bf16 model, bf16 index-K (2 bytes a value, where fp8 would be 1). What P sends is
    recorded per destination page at the write, by P's layout; when D starts decoding a room,
    each of its pages must hold, by D's layout, exactly what P wrote there for that room."""
    wire = Wire(ds_dir, page_size=PAGE, chunk=64, dtype="bfloat16")
    assert wire.d.pool.layout.buffer("index_k").dtype == "bfloat16"
    p_layout, d_layout = wire.p.pool.layout, wire.d.pool.layout
    sent: dict[int, tuple[int, list[bytes]]] = {}  # D's page -> (room, P's bytes)
    real_write = ShmWriter.write

    def write(self: ShmWriter, room: int, epoch: int, src: Any, src_pages: Any, dst_pages: Any,
              *args: Any, **kw: Any) -> Any:  # fmt: skip
        for s, d in zip(src_pages, dst_pages, strict=True):
            sent[d] = (room, regions(p_layout, src.read([s])[0], (*INDEX, "latent")))
        return real_write(self, room, epoch, src, src_pages, dst_pages, *args, **kw)

    checked: list[int] = []
    wrong: list[str] = []  # not raised in here: the engine would isolate it as a failed step
    real_adopt, real_command = wire.d.scheduler.adopt, wire.d_role._run_command
    started: dict[str, int] = {}  # request -> its room, at START_DECODE (the room ends there)

    def run_command(room: Any, c: Cmd, now: float) -> None:
        if c is Cmd.START_DECODE:
            started[room.request.request_id] = room.room
        real_command(room, c, now)

    def adopt(req: Any, lease: Any) -> None:
        room = started[req.request_id]
        for page in lease.pages:
            got = regions(d_layout, wire.d.pool.page(page), (*INDEX, "latent"))
            if sent.get(page) != (room, got):
                wrong.append(f"{req.request_id}: page {page}")
            checked.append(page)
        real_adopt(req, lease)

    monkeypatch.setattr(ShmWriter, "write", write)
    monkeypatch.setattr(wire.d.scheduler, "adopt", adopt)
    monkeypatch.setattr(wire.d_role, "_run_command", run_command)
    ps = prompts(32, seed=3, hi=18)
    two = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outs = {f"r{i}": wire.submit(f"r{i}", p, two) for i, p in enumerate(ps)}
    aborted = ["r3", "r7", "r11"]  # before anything ran
    for rid in aborted:
        wire.d.abort(rid)
    for step, rid in enumerate(("r13", "r17", "r21", "r25", "r29")):  # mid-flight
        for _ in range(step + 1):
            wire.tick()
        wire.d.abort(rid)
        aborted.append(rid)
    wire.run_until(lambda: all(ended(o) for o in outs.values()))
    wire.run_until(wire.idle)
    assert wrong == []
    finished = {rid: o[-1].finish_reason for rid, o in outs.items()}
    assert all(finished[r] == "length" for r in outs if r not in aborted), finished
    assert all(finished[r] in ("abort", "length") for r in aborted)
    assert len(checked) >= sum(-(-len(p) // PAGE) for p in ps[:3])  # r0..r2 were not aborted
    assert wire.violations() == []


@pytest.mark.parametrize("mode", ["auto", "fp8"])
def test_index_k_pages_come_back_byte_exact_from_the_host_tier(ds_dir, mode, monkeypatch) -> None:
    """Pages evicted to the host tier are recorded as they leave; each page loaded back must
    hold exactly those bytes, index-K (and its scales) included."""
    layout = KVLayout.for_model(ModelArch.from_dir(ds_dir), "float32", PAGE, mode)
    cfg = EngineConfig(
        ModelSpec(str(ds_dir), "v32", dtype="float32", device="cpu"),
        CacheConfig(PAGE, layout.page_bytes * 8, True, layout.page_bytes * 32, mode),
        SchedulerConfig(max_batched_tokens=64, max_running=4, max_model_len=256),
        RunnerConfig(),
    )
    e = Engine.build(cfg, frozenset())
    evicted: dict[int, list[bytes]] = {}  # host page -> the device page's bytes
    loaded: list[int] = []
    wrong: list[int] = []  # not raised in load: a failed load would fall back to computing
    real_store, real_load = HostPool.store, HostPool.load

    def store(self: HostPool, pages: Any) -> Any:
        before = {ev.key: regions(layout, self.device.page(ev.page), INDEX) for ev in pages}
        out = real_store(self, pages)
        for key, data in before.items():
            if key in self._entries:
                evicted[self._entries[key].page] = data
        return out

    def load(self: HostPool, host_pages: Any, device_pages: Any) -> Any:
        copy = real_load(self, host_pages, device_pages)  # synchronous on the CPU
        for h, d in zip(host_pages, device_pages, strict=True):
            if regions(layout, self.device.page(d), INDEX) != evicted[h]:
                wrong.append(h)
            loaded.append(h)
        return copy

    monkeypatch.setattr(HostPool, "store", store)
    monkeypatch.setattr(HostPool, "load", load)
    first, flood = prompts(2, seed=4, lo=20, hi=21)  # 5 pages each, 8 on the device
    want = generate(e, [first], GREEDY)
    generate(e, [flood], GREEDY)  # pushes the first prompt's pages to the host
    assert generate(e, [first], GREEDY) == want
    cache = e.prefix_cache
    assert wrong == []
    assert cache is not None and cache.stats.host_hits >= 1
    assert len(loaded) == cache.stats.host_loaded_pages >= 2
    assert any(b.strip(b"\0") for data in evicted.values() for b in data)  # not blank pages
