"""The host tier in the scheduler and the engine: a lookup continues into host memory, the
request waits for its load, then prefills only the rest; a load that times out falls back to
computing; a request that leaves while loading frees nothing the copy still writes; outputs
are the same with the cache off, on, and on with a host tier."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelSpec, RunnerConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.offline import generate
from pdserve.engine.request import Event, Request, Status
from pdserve.engine.scheduler import Scheduler
from pdserve.engine_flags import add_engine_args, engine_config
from pdserve.kvcache.host_copier import ManualCopier
from pdserve.kvcache.host_pool import HostPool
from pdserve.kvcache.layout import BufferSpec, KVLayout
from pdserve.kvcache.lease import Lease, Leases
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime import timing

PS = 4
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
SIG = KVLayout((BufferSpec("sig", (1,), "int64"),), page_size=PS, num_layers=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sched(
    pages: int, host_pages: int, copier: ManualCopier | None = None, **cfg: int
) -> tuple[Scheduler, KVPool, Clock]:
    """A scheduler over a pool whose one int64 buffer holds a signature per token (`sig`)."""
    pool = KVPool(SIG, pages, torch.device("cpu"))
    leases = Leases(pool.allocator)
    cache = PrefixCache(leases, PS, HostPool(pool, host_pages, copier))
    clock = Clock()
    assert cache.loads is not None
    cache.loads.clock = clock
    return Scheduler(SchedulerConfig(**cfg), leases, PS, cache), pool, clock


def sig(ids: list[int], i: int) -> int:
    """The 'KV' of position i: a function of every token up to it, as real KV is."""
    return hash(tuple(ids[: i + 1])) & (2**62 - 1)


def compute(s: Scheduler, pool: KVPool, rng: random.Random | None = None) -> list[Request]:
    """One step: check that every chunk reads the KV its tokens have (positions before its
    start) and writes only pages its request holds alone, then write its signatures."""
    kv = pool.view(0, "sig")
    plan = s.schedule()
    for c in plan.chunks:
        r, pages = c.request, c.request.pages
        ids = r.all_ids
        for i in range(c.start):
            got = int(kv[pages[i // PS], i % PS, 0])
            assert got == sig(ids, i), f"{r.request_id} reads wrong KV at {i}"
        for i in range(c.start, c.start + c.length):
            assert s.allocator.refcount(pages[i // PS]) == 1, f"{r.request_id} writes a shared page"
            kv[pages[i // PS], i % PS, 0] = sig(ids, i)
    for c in plan.chunks:
        c.request.num_computed = c.start + c.length
        if c.samples:
            c.request.output_ids.append(rng.randrange(1, 30) if rng else 7)
    return [c.request for c in plan.chunks]


def ok(s: Scheduler) -> None:
    assert s.cache is not None
    assert s.leases.violations() == [] and s.cache.violations() == []


def req(rid: str, prompt: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), sink=lambda o: None)


def evicted_to_host(s: Scheduler, pool: KVPool, prompt: list[int]) -> None:
    """Run `prompt` until it samples, finish it, and push its cached pages to the host."""
    a = req("warm", prompt)
    s.add(a)
    while not a.output_ids:
        compute(s, pool)
    s.finish(a, Event.STOP)
    assert s.cache is not None and s.cache.clear() > 0


def test_a_host_hit_is_loaded_and_only_the_rest_is_computed():
    s, pool, _ = sched(16, 16, max_batched_tokens=64)
    prompt = list(range(1, 15))  # 3 full pages and 2 tokens
    evicted_to_host(s, pool, prompt)
    b = req("b", prompt[:12] + [99, 98])
    s.add(b)
    (computed,) = compute(s, pool)  # the CPU's copies end at once: loaded and admitted
    assert computed is b and b.num_computed == 14
    assert s.cache is not None and s.cache.stats.host_loaded_pages == 3
    assert s.cache.stats.host_hit_tokens == 12 and s.cache.stats.hit_tokens == 12
    assert len(s.cache) == 3  # the loaded pages are in the device cache again
    ok(s)


def test_a_waiting_load_holds_its_request_and_lets_others_go_first():
    copier = ManualCopier()
    s, pool, _ = sched(32, 16, copier, max_batched_tokens=64)
    prompt = list(range(1, 15))
    evicted_to_host(s, pool, prompt)
    b, c = req("b", prompt), req("c", list(range(50, 60)))
    s.add(b)
    s.add(c)
    assert compute(s, pool) == [c]  # b's pages are on their way
    assert b.status is Status.WAITING and s.counts()["loading"] == 1 and s.has_work()
    ok(s)
    copier.complete()
    assert compute(s, pool) == [c, b]  # c decodes; b, loaded, prefills its last 2 tokens
    assert b.num_computed == 14 and s.cache is not None
    assert s.cache.stats.host_hits == 1 and s.cache.stats.queries == 3
    ok(s)


def test_a_load_past_its_deadline_falls_back_to_computing_and_frees_late():
    copier = ManualCopier()
    s, pool, clock = sched(16, 16, copier, max_batched_tokens=64)
    prompt = list(range(1, 15))
    evicted_to_host(s, pool, prompt)
    b = req("b", prompt)
    s.add(b)
    assert compute(s, pool) == []
    used = s.allocator.num_used
    clock.now += timing.HOST_LOAD_TIMEOUT_S + 1
    assert compute(s, pool) == [b] and b.num_computed == 14  # all of it, computed
    assert s.cache is not None and s.cache.stats.host_load_timeouts == 1
    assert s.cache.stats.host_hit_tokens == 0 and s.cache.loads is not None
    (stuck,) = s.cache.loads.abandoned  # its 3 pages stay out of use until the copy ends
    assert stuck.lease.live and s.allocator.num_used >= used
    ok(s)
    copier.complete()  # the late bytes land in pages nobody else holds
    compute(s, pool)
    assert not stuck.lease.live and s.cache.loads.abandoned == []
    ok(s)


def test_an_abort_while_loading_frees_the_pages_only_after_the_copy():
    copier = ManualCopier()
    s, pool, _ = sched(16, 16, copier, max_batched_tokens=64)
    prompt = list(range(1, 15))
    evicted_to_host(s, pool, prompt)
    b = req("b", prompt)
    s.add(b)
    compute(s, pool)
    assert s.cache is not None and s.cache.loads is not None
    load = s.cache.loads.active["b"]
    s.finish(b, Event.ABORT)
    assert load.lease.live and s.has_work()  # the copy still writes them
    held = list(load.lease.pages)
    assert all(s.allocator.refcount(p) == 1 for p in held)
    ok(s)
    copier.complete()
    s.schedule()
    assert not load.lease.live and not s.has_work()
    assert all(s.allocator.refcount(p) == 0 for p in held)
    assert s.cache.host is not None and s.cache.host.pins == {}
    ok(s)


def test_random_inserts_hits_evictions_loads_aborts_and_preemptions_keep_every_count():
    """Seeded random workloads on a small device pool and a smaller host pool, loads that
    end late, fail or time out: after every step each device page's count is its leases',
    the host pool's accounting holds, and every chunk reads exactly its tokens' KV."""
    rng = random.Random(11)
    copier = ManualCopier()
    s, pool, clock = sched(14, 10, copier, max_batched_tokens=16, max_running=5)
    assert s.cache is not None and s.cache.loads is not None
    prefixes = [[rng.randrange(1, 30) for _ in range(14)] for _ in range(4)]
    kept: list[Lease] = []
    made: list[Request] = []
    abandoned = 0  # requests that left while loading
    for step in range(1500):
        op = rng.random()
        live = s.running + list(s.waiting)
        if op < 0.12:
            prompt = rng.choice(prefixes)[: rng.randint(1, 14)]
            prompt += [rng.randrange(1, 30) for _ in range(rng.randint(0, 5))]
            made.append(req(f"r{step}", prompt, rng.randint(1, 24)))
            s.add(made[-1])
        elif op < 0.16 and live:
            r = rng.choice(live)
            abandoned += s.cache.loads.loading(r.request_id)
            s.finish(r, rng.choice([Event.ABORT, Event.FAIL]))
        elif op < 0.18 and live:
            r = rng.choice(live)
            ev = Event.STOP if r.status is Status.RUNNING else Event.ABORT
            lease = s.hand_over(r, ev, f"room {step}")
            if lease is not None:
                kept.append(lease)
        elif op < 0.21 and kept:
            kept.pop(rng.randrange(len(kept))).release()
        elif op < 0.25:
            s.cache.evict(rng.randint(1, 4))  # to the host
        elif op < 0.33 and copier.queue:
            upto = rng.choice(copier.queue)[0]
            copier.complete(upto, fail=rng.random() < 0.15)
        elif op < 0.35:
            clock.now += rng.choice([0.1, timing.HOST_LOAD_TIMEOUT_S + 0.1])
        else:
            compute(s, pool, rng)
            for r in list(s.running):
                if len(r.output_ids) >= r.params.max_tokens:
                    s.finish(r, Event.LENGTH)
        ok(s)
    st = s.cache.stats
    assert st.host_written_pages > 0 and st.host_loaded_pages > 0 and st.host_hit_tokens > 0
    assert st.host_load_timeouts > 0 and st.host_load_failures > 0 and st.host_evicted_pages > 0
    assert sum(r.num_preemptions for r in made) > 5 and abandoned > 5
    for r in s.running + list(s.waiting):
        s.finish(r, Event.ABORT)
    for lease in kept:
        lease.release()
    copier.complete()
    s.schedule()
    assert not s.has_work() and s.allocator.num_used == s.allocator.num_evictable
    ok(s)


# -- the engine, tiny model ---------------------------------------------------------------
def build(tiny_dir, cache: bool, pages: int, host_pages: int = 0, device: str = "cpu") -> Engine:
    bpp = page_bytes(tiny_dir)
    cfg = EngineConfig(
        ModelSpec(str(tiny_dir), "tiny", dtype="float32", device=device),
        CacheConfig(PS, bpp * pages, cache, bpp * host_pages),
        SchedulerConfig(max_batched_tokens=64, max_running=4, max_model_len=256),
        RunnerConfig(),  # the device's backend; on CUDA, overlapped steps and graphs
    )
    return Engine.build(cfg, frozenset())


def page_bytes(tiny_dir) -> int:
    from pdserve.model.config import ModelArch

    arch = ModelArch.from_dir(tiny_dir)
    return KVLayout.llama(
        "float32", PS, arch.num_layers, arch.num_kv_heads, arch.head_dim
    ).page_bytes


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts run one by one, a flood before each repeat pushing the earlier pages out of a
    12-page device pool into the host tier; and the repeats."""
    g = torch.Generator().manual_seed(8)
    system = torch.randint(3, 2000, (22,), generator=g).tolist()
    first = system + torch.randint(3, 2000, (5,), generator=g).tolist()
    flood = torch.randint(3, 2000, (36,), generator=g).tolist()
    again = [
        first,  # whole pages from the host tier
        system[:13] + [7, 8, 9],  # a hit ending inside a page
        first[:10],  # a prefix of an earlier prompt
        first + [11, 12, 13, 14, 15],  # an earlier prompt is its prefix
    ]
    return [first] + [p for a in again for p in (flood, a)], again


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_outputs_are_the_same_with_the_cache_off_on_and_on_with_a_host_tier(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    prompts, again = workload()
    off = build(tiny_dir, False, 64, device=device)
    on = build(tiny_dir, True, 64, device=device)
    tier = build(tiny_dir, True, 12, host_pages=64, device=device)  # 48 tokens on the device
    want = [generate(off, [p], GREEDY)[0] for p in prompts]
    assert [generate(on, [p], GREEDY)[0] for p in prompts] == want
    assert [generate(tier, [p], GREEDY)[0] for p in prompts] == want
    cache = tier.prefix_cache
    assert cache is not None and cache.host is not None
    assert cache.host.data.is_pinned() == (device == "cuda")  # exactly its size, page-locked
    st = cache.stats
    assert st.host_hits >= 4 and st.host_loaded_pages > 0 and st.host_written_pages > 0
    generate(tier, [prompts[1]], GREEDY)  # the flood again: the repeats go to the host
    assert generate(tier, again, GREEDY) == want[2::2]  # together, loads in one step
    assert tier.leases.violations() == [] and cache.violations() == []
    assert tier.pool.allocator.num_used == tier.pool.allocator.num_evictable
    state = tier._snapshot()
    assert state["prefix_cache"]["host"]["loaded_pages"] == st.host_loaded_pages
    assert state["pool"]["lease_violations"] == [] and state["pool"]["leases"] == 0
    tier.step()  # the metrics follow the stats
    text = tier.metrics.render().decode()
    assert f"pdserve_prefix_cache_host_hit_tokens_total {float(st.host_hit_tokens)}" in text
    assert "pdserve_prefix_cache_host_load_timeouts_total 0.0" in text


def test_a_prefill_worker_serves_a_repeat_from_its_host_tier(tiny_dir, monkeypatch):
    """PD in one process: P's cached pages go to its host tier; the repeat loads them, P
    still writes every page D needs, and D decodes the same tokens."""
    from pdserve.engine import offline
    from tests.worker.wire import Wire, ended, tokens

    def with_host(*args: object, **kw: object) -> CacheConfig:
        return CacheConfig(*args, host_cache_bytes=2**20, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(offline, "CacheConfig", with_host)
    w = Wire(tiny_dir)
    prompt = [(i * 7) % 200 + 3 for i in range(37)]  # 9 full pages of 4 and a token
    outs = []
    for rid in ("first", "again"):
        outs.append(w.submit(rid, prompt, GREEDY))
        w.run_until(lambda: ended(outs[-1]) and not w.p_role.by_room and not w.d_role.by_room)
        cache = w.p.prefix_cache
        assert cache is not None and cache.clear() > 0  # P's pages: to its host tier
    assert tokens(outs[0]) == tokens(outs[1]) and outs[1][-1].finish_reason == "length"
    st = cache.stats
    assert st.host_hits == 1 and st.host_hit_tokens == 36 and st.host_loaded_pages == 9
    assert w.idle() and w.violations() == [] and cache.violations() == []
    assert w.p.pool.allocator.num_used == w.p.pool.allocator.num_evictable


def test_host_cache_flag_and_config(tiny_dir):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", str(tiny_dir), "--host-cache-mb", "1.5", "--device", "cpu"])
    assert engine_config(args).cache.host_cache_bytes == int(1.5 * 2**20)
    assert engine_config(p.parse_args(["--model", str(tiny_dir)])).cache.host_cache_bytes == 0
    with pytest.raises(ValueError, match="needs the prefix cache"):
        engine_config(
            p.parse_args(["--model", str(tiny_dir), "--host-cache-mb", "1", "--no-prefix-cache"])
        )
    decode = p.parse_args(["--model", str(tiny_dir), "--host-cache-mb", "1"])
    decode.role = "decode"  # `serve --role decode`: it never looks its cache up
    assert engine_config(decode).cache.host_cache_bytes == 0
    with pytest.raises(ValueError, match=">= 0"):
        CacheConfig(host_cache_bytes=-1)
