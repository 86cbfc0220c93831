"""DeepSeek-V4 through PD (a prefill and a decode role in one process, KV over shm): greedy
parity with HF on the issue's prompt lengths; every component D decodes from, paged and
per-request state, byte-equal to what P computed; P refuses state pages that are not one of
D's slots; nothing leaked, pages or state slots. (tcp and nixl through `pdserve launch`:
tests/router/test_launch_deepseek_v4.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.offline import build_engine, generate
from pdserve.kvcache.pool import KVPool
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.dataplane import ShmWriter
from pdserve.worker.decode.role import DecodeRole
from pdserve.worker.prefill.rooms import check_prefill_request
from tests.engine.test_parity import prompts_for
from tests.helpers import hf_greedy
from tests.worker.wire import Wire

pytest.importorskip("transformers")

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LENGTHS = [5, 77, 131, 258, 301, 517]


@pytest.fixture(scope="module")
def v4_dir(builtin_dir) -> Path:  # type: ignore[no-untyped-def]
    return builtin_dir("deepseek-v4-tiny")


def wire(v4_dir: Path, chunk: int = 100) -> Wire:
    return Wire(v4_dir, page_size=128, chunk=chunk, d_kv_mb=16, p_kv_mb=16)


def test_pd_equals_hf_and_leaks_nothing(v4_dir) -> None:
    prompts = prompts_for(2000, LENGTHS, seed=5)
    w = wire(v4_dir)
    assert w.d.pool.state is not None and w.p.pool.state is not None
    got = w.run_jobs([(p, GREEDY) for p in prompts])
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == hf_greedy(v4_dir, prompts, NEW_TOKENS)
    assert all(reason == "length" for _, reason in got.values())
    assert w.violations() == []
    for pool in (w.p.pool, w.d.pool):
        assert pool.state is not None and pool.state.num_free == pool.state.num_slots


def components(pool: KVPool, page: int, data: torch.Tensor) -> dict[str, bytes]:
    """A page's bytes by component: a KV page's (layer, buffer) regions, or, for a page of a
    state slot, the parts of the slot's regions it holds."""
    state = pool.state
    assert state is not None
    if page < pool.num_pages:
        regions = [(f"{r.spec.name}@{r.layer}", r.offset, r.nbytes) for r in pool.layout.regions]
    else:
        base = (page - state.first_pool_page) % state.pages_each * pool.layout.page_bytes
        regions = [(f"{r.spec.name}@{r.layer}", r.offset - base, r.nbytes) for r in state.regions]
    out = {}
    for name, offset, nbytes in regions:
        lo, hi = max(offset, 0), min(offset + nbytes, pool.layout.page_bytes)
        if lo < hi:
            out[name] = bytes(data[lo:hi].numpy())
    return out


def watch_byte_exact(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """From now on, every page P writes for a room (its KV pages and its state slot's), as P
    held it when the write was posted, must equal D's page when D takes the room's
    PrefillDone, component by component. Returns the set of components checked so far."""
    sent: dict[int, torch.Tensor] = {}  # D's page -> P's bytes for it
    real_write = ShmWriter.write

    def write(self, room, epoch, src, src_pages, dst_pages, deadline, ready):  # type: ignore[no-untyped-def]
        for s, d in zip(src_pages, dst_pages, strict=True):
            sent[d] = src.read([s])[0].clone()
        return real_write(self, room, epoch, src, src_pages, dst_pages, deadline, ready)

    checked: set[str] = set()
    real_done = DecodeRole._try_done

    def try_done(self, room, now):  # type: ignore[no-untyped-def]
        pages = [*room.lease.pages, *room.state_pages(self.pool)]
        assert set(pages) <= set(sent), "D decodes from a page P never wrote"
        for page in pages:
            ours = components(self.pool, page, self.pool.page(page))
            theirs = components(self.pool, page, sent.pop(page))
            bad = [name for name in ours if ours[name] != theirs[name]]
            assert not bad, f"page {page}: {bad}"
            checked.update(name.split("@")[0] for name in ours)
        return real_done(self, room, now)

    monkeypatch.setattr(ShmWriter, "write", write)
    monkeypatch.setattr(DecodeRole, "_try_done", try_done)
    return checked


def test_every_component_arrives_byte_exact(v4_dir, monkeypatch) -> None:
    """watch_byte_exact over three prompts: every paged buffer and state component checked."""
    w = wire(v4_dir, chunk=64)
    checked = watch_byte_exact(monkeypatch)
    prompts = prompts_for(2000, [131, 301, 5], seed=6)
    got = w.run_jobs([(p, GREEDY) for p in prompts])
    assert all(reason == "length" for _, reason in got.values())
    layout = w.d.pool.layout
    assert checked == {b.name for b in layout.buffers} | {s.name for s in layout.state}


def test_state_pages_that_are_not_a_slot_are_refused() -> None:
    msg = m.PrefillRequest(
        room=1, epoch=1, prompt_ids=[3] * 10, dst_pages=[0], params=GREEDY, write_deadline=1e12,
        state_pages=[9, 10],
    )  # fmt: skip
    ok = lambda _ids, _params: None  # noqa: E731
    why = check_prefill_request(msg, 8, 1, ok, 0.0, (range(8, 20), 3))
    assert why == "state_pages invalid: 3 pages in [8, 20) needed"
    why = check_prefill_request(msg, 8, 1, ok, 0.0, None)
    assert why == "state_pages given, but the KV layout keeps no per-request state"
    fine = msgspec_replace(msg, state_pages=[11, 12, 13])
    assert not isinstance(check_prefill_request(fine, 8, 1, ok, 0.0, (range(8, 20), 3)), str)


def msgspec_replace(msg: m.PrefillRequest, **kw: object) -> m.PrefillRequest:
    import msgspec

    return msgspec.structs.replace(msg, **kw)


def test_p_resumes_a_conversation_from_its_cache(v4_dir) -> None:
    """P computes the second turn from its cached pages (its state slot rebuilt from the last
    cached page's end) and ships all of it: D decodes what an engine without a cache would."""
    (first,) = prompts_for(2000, [300], seed=13)
    w = wire(v4_dir)
    reply = w.run_jobs([(first, GREEDY)])["r0"][0]
    second = first + reply + prompts_for(2000, [40], seed=14)[0]
    got = w.run_jobs([(second, GREEDY)])["r0"][0]
    plain = build_engine(v4_dir, max_batched_tokens=100, kv_budget_mb=16.0, prefix_cache=False)
    assert got == generate(plain, [second], GREEDY)[0]
    assert w.p.prefix_cache is not None and w.p.prefix_cache.stats.hit_tokens == 256
    assert w.violations() == []
