"""DeepSeek-V4's pages through the host tier, component by component: every page evicted to
host memory comes back holding exactly the bytes it left with, each compressed buffer and each
page-end row (ring, CSA overlap), in both KV modes; and the conversation that resumes from them
decodes what an engine without a cache decodes."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelSpec, RunnerConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.offline import generate
from pdserve.kvcache.host_pool import HostPool
from pdserve.kvcache.layout import KVLayout
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_parity import prompts_for

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine(v4_dir, mode: str, cache: bool = True) -> Engine:  # type: ignore[no-untyped-def]
    probe = Engine.build(config(v4_dir, mode, 1 << 26, 0, cache), frozenset())
    assert probe.pool.state is not None
    page = probe.pool.layout.page_bytes
    slots = 4 * probe.pool.state.pages_each * page
    host = 16 * page if cache else 0
    return Engine.build(config(v4_dir, mode, 5 * page + slots, host, cache), frozenset())


def config(v4_dir, mode: str, budget: int, host: int, cache: bool) -> EngineConfig:  # type: ignore[no-untyped-def]
    return EngineConfig(
        ModelSpec(str(v4_dir), "v4", dtype="float32", device="cpu"),
        CacheConfig(128, budget, cache, host, kv_dtype=mode),
        SchedulerConfig(max_batched_tokens=96, max_running=4, max_model_len=1024),
        RunnerConfig(),
    )


def components(layout: KVLayout, page: Any) -> dict[str, bytes]:
    return {
        f"{r.spec.name}@{r.layer}": bytes(page[r.offset : r.offset + r.nbytes].numpy())
        for r in layout.regions
    }


@pytest.mark.parametrize("mode", ["auto", "fp8"])
def test_every_component_comes_back_byte_exact(builtin_dir, mode, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    v4_dir = builtin_dir("deepseek-v4-tiny")
    e = engine(v4_dir, mode)
    layout = e.pool.layout
    evicted: dict[int, dict[str, bytes]] = {}  # host page -> the device page's components
    wrong: list[str] = []
    checked: set[str] = set()
    real_store, real_load = HostPool.store, HostPool.load

    def store(self: HostPool, pages: Any) -> Any:
        before = {ev.key: components(layout, self.device.page(ev.page)) for ev in pages}
        out = real_store(self, pages)
        for key, data in before.items():
            if key in self._entries:
                evicted[self._entries[key].page] = data
        return out

    def load(self: HostPool, host_pages: Any, device_pages: Any) -> Any:
        copy = real_load(self, host_pages, device_pages)  # synchronous on the CPU
        for h, d in zip(host_pages, device_pages, strict=True):
            back = components(layout, self.device.page(d))
            wrong.extend(name for name in back if back[name] != evicted[h][name])
            checked.update(name.split("@")[0] for name in back)
        return copy

    monkeypatch.setattr(HostPool, "store", store)
    monkeypatch.setattr(HostPool, "load", load)
    (first,) = prompts_for(2000, [300], seed=10)
    reply = generate(e, [first], GREEDY)[0]
    for p in prompts_for(2000, [260, 270], seed=11):  # evicts the first's pages to the host
        generate(e, [p], GREEDY)
    second = first + reply + prompts_for(2000, [30], seed=12)[0]
    plain = engine(v4_dir, mode, cache=False)
    assert generate(e, [second], GREEDY) == generate(plain, [second], GREEDY)
    assert wrong == []
    assert checked == {b.name for b in layout.buffers}  # every paged component came back
    assert e.prefix_cache is not None and e.prefix_cache.stats.host_loaded_pages >= 2
