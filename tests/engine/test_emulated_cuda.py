"""The CUDA-only host paths, on the CPU: overlapped steps through the graph buckets with the
staging buffer reused as on a GPU, every static buffer poisoned before each replay.

On CUDA the staging device buffer is reused by every upload (on the CPU each upload is a fresh
clone), steps replay captured graphs over static buffers, and the next step is built while the
last is in flight. Here: `ReusedStaging` copies each upload into one persistent buffer, wiped
with junk first (a read of an older upload's part sees junk or this step's values, as a kernel
queued behind the next copy would on one stream), and kills the host buffer once copied; the
graphs are the eager stand-ins of test_prefill_graphs.py over real static buffers; before every
replay those buffers are filled with junk and their slots with the step's own real slots (a row
the step fails to rewrite then stores its K/V over a live page). Each workload must give the
plain loop's tokens exactly, and a planted pad bug must be caught.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pdserve.attention.decode_bucket import copy_decodes
from pdserve.attention.staging import Staging
from pdserve.attention.triton_backend import TritonBackend
from pdserve.engine import cuda_graphs
from pdserve.engine.cuda_graphs import BucketGraphs, DecodeGraphs, bucket_for
from pdserve.engine.offline import build_engine
from pdserve.engine.prefill_graphs import PrefillGraphs
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_overlap import PROMPTS, assorted, run
from tests.engine.test_prefill_graphs import without_capture
from tests.helpers import make_engine

JUNK = -1_234_567


class ReusedStaging(Staging):
    """Staging whose device buffer is one persistent tensor, as on CUDA (see the module doc)."""

    _reused: torch.Tensor | None = None
    uploads = 0

    def _to_device(self, end: int) -> torch.Tensor:
        self.uploads += 1
        buf = self._reused
        if buf is None or buf.numel() < self.capacity:
            with torch.inference_mode(False):
                buf = self._reused = torch.empty(self.capacity, dtype=self.dtype)
        buf.fill_(JUNK)
        flat = buf[:end]
        flat.copy_(self._host[:end])
        self._host_np[:end] = JUNK  # the pinned source is dead once its copy has run
        return flat


def poisoned_replay(real: Any) -> Any:
    def replay(self: BucketGraphs, batch: Any, rows: slice, prepare: Any) -> torch.Tensor:
        g = self.graphs[bucket_for(batch.input_ids[rows].shape[0], self.sizes) or 0]
        b = g.buffers
        g.input_ids.fill_(5)
        g.positions.fill_(9)
        live = batch.slot_mapping[batch.slot_mapping >= 0]
        if live.numel():  # a row left as it is stores its K/V over a live page
            n = b.slot_mapping.numel()
            b.slot_mapping.copy_(live.repeat(-(-n // live.numel()))[:n])
        for kv in (
            getattr(b, "kv_lens", None),
            getattr(getattr(b, "decode", None), "kv_lens", None),
        ):
            if kv is not None:
                kv.fill_(3)
        if hasattr(b, "query_start"):
            b.query_start.copy_(torch.arange(b.query_start.numel(), dtype=b.query_start.dtype))
        return real(self, batch, rows, prepare)

    return replay


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cuda_graphs.BucketGraphs, "replay", poisoned_replay(cuda_graphs.BucketGraphs.replay)
    )


def engine(tiny_dir: Any, emulate: bool, **kw: Any) -> Any:
    """The triton backend's engine; emulated: overlapped, through the graph buckets, staging
    reused (plain: the eager loop)."""
    eng = build_engine(tiny_dir, attention_backend="triton", overlap_schedule=emulate, **kw)
    if emulate:
        r = eng.runner
        r.builder.staging = ReusedStaging(r.device, r.builder.staging.dtype)
        max_pages = -(-min(eng.max_model_len, r.pool.capacity_tokens) // r.pool.page_size)
        with torch.inference_mode():
            r.graphs = without_capture(
                DecodeGraphs(r.model, r.backend, max_pages, kw.get("max_running", 8))
            )
            r.prefill_graphs = without_capture(
                PrefillGraphs(
                    r.model, r.backend, max_pages, kw["max_batched_tokens"], r.graphs.sizes[-1]
                )
            )
    return eng


def random_jobs(
    seed: int, page_bytes: int
) -> tuple[dict[str, Any], list[tuple[list[int], SamplingParams]]]:
    """A seeded workload under memory pressure (test_overlap.py's): the engine's settings and
    its requests, greedy and seeded draws, some with stop ids."""
    rng = random.Random(seed)
    kw = {
        "page_size": 4,
        "max_batched_tokens": rng.choice([2, 3, 5, 8, 16]),
        "max_running": rng.randint(2, 6),
        "kv_budget_mb": rng.randint(6, 12) * page_bytes / 2**20 + 1e-9,
        "max_model_len": 1024,
        "prefix_cache": rng.random() < 0.5,
    }
    jobs = []
    for _ in range(rng.randint(3, 7)):
        stops = tuple(rng.sample(range(3, 4000), 30)) if rng.random() < 0.5 else ()
        params = SamplingParams(
            max_tokens=rng.randint(1, 10),
            temperature=0 if rng.random() < 0.5 else 1.5,
            seed=rng.randint(0, 99),
            ignore_eos=True,
            stop_token_ids=stops,
        )
        jobs.append(([rng.randint(3, 60) for _ in range(rng.randint(1, 12))], params))
    return kw, jobs


@pytest.fixture(scope="module")
def page_bytes(tiny_dir: Any) -> int:
    """One KV page of the tiny model at page size 4 (the random workloads' pool is 6-12)."""
    return int(make_engine(tiny_dir, page_size=4).pool.layout.page_bytes)


@pytest.fixture(scope="module")
def plain_loop(tiny_dir: Any, page_bytes: int) -> Any:
    """The plain loop's tokens for `random_jobs(seed)`, run once per seed in this module: two
    tests compare other paths to seed 9's (the plain loop is deterministic, as both rely on)."""
    done: dict[int, Any] = {}

    def tokens(seed: int) -> Any:
        if seed not in done:
            kw, jobs = random_jobs(seed, page_bytes)
            done[seed] = run(engine(tiny_dir, False, **kw), jobs)
        return done[seed]

    return tokens


@pytest.mark.parametrize("seed", [9, 11])  # preempting workloads that replay both kinds
def test_random_workloads_through_the_emulated_cuda_path_equal_the_plain_loop(
    tiny_dir: Any, emulated: None, page_bytes: int, plain_loop: Any, seed: int
) -> None:
    kw, jobs = random_jobs(seed, page_bytes)
    want = plain_loop(seed)
    eng = engine(tiny_dir, True, **kw)
    assert run(eng, jobs) == want
    assert eng.runner.graphs.replays > 0 and eng.runner.prefill_graphs.replays > 0
    assert eng.runner.builder.staging.uploads > eng.runner.graphs.replays


def test_every_kind_of_request_through_the_emulated_cuda_path(tiny_dir: Any, emulated: None):
    """A seeded top-k draw, a stop id the greedy run really samples, penalties counted on the
    device (a token in flight included) and logprobs, joining one by one (test_overlap.py's
    kinds; short prompts: Triton's interpreter runs every padded program of a bucket)."""
    kinds = assorted(tiny_dir)
    jobs = [(PROMPTS[k], kinds[i]) for k, i in zip((0, 4, 1, 2, 3), (2, 4, 7, 8, 9), strict=True)]
    kw = {"page_size": 16, "max_batched_tokens": 16, "max_running": 6, "kv_budget_mb": 16.0}
    want = run(engine(tiny_dir, False, max_model_len=128, **kw), jobs, stagger=2)
    eng = engine(tiny_dir, True, max_model_len=128, **kw)
    assert run(eng, jobs, stagger=2) == want
    assert eng.runner.graphs.replays > 0 and eng.runner.prefill_graphs.replays > 0


def test_the_emulation_catches_a_decode_bucket_left_unpadded(
    tiny_dir: Any,
    emulated: None,
    page_bytes: int,
    plain_loop: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted: padded decode rows keep the poisoned (live) slots; the outputs must differ."""

    def unpadded(self: TritonBackend, batch: Any, buffers: Any) -> Any:
        n = batch.num_decodes
        copy_decodes(batch, buffers)
        buffers.slot_mapping[:n].copy_(batch.slot_mapping[:n])
        return self.decode_metadata(buffers)

    kw, jobs = random_jobs(9, page_bytes)
    want = plain_loop(9)  # the plain loop replays no graph: the planted bug cannot reach it
    monkeypatch.setattr(TritonBackend, "prepare_decode_into", unpadded)
    assert run(engine(tiny_dir, True, **kw), jobs) != want


@pytest.mark.parametrize("model", ["deepseek-v3-tiny", "deepseek-v32-tiny"])
def test_deepseek_decodes_through_the_emulated_graph_buckets(
    builtin_dir: Any, emulated: None, model: str
) -> None:
    """DeepSeek-V3's latent decode (V3.2's: over its indexer's picks) through the decode
    buckets (attention/mla_backend.py's static metadata; its stores skip the padded rows),
    overlapped, the buffers poisoned before each replay: the plain loop's tokens, greedy and
    seeded, requests joining one by one (V3.2's prompts past its index_topk of 12)."""
    ds = builtin_dir(model)
    kw: dict[str, Any] = {
        "page_size": 4,
        "max_batched_tokens": 12,
        "max_running": 5,
        "kv_budget_mb": 4.0,
        "max_model_len": 128,
        "attention_backend": "triton",
    }
    rng = random.Random(3)
    jobs = [
        (
            [rng.randint(3, 4000) for _ in range(n)],
            SamplingParams(max_tokens=m, temperature=t, seed=i, ignore_eos=True),
        )
        for i, (n, m, t) in enumerate(
            [(5, 14, 0), (13, 9, 1.2), (3, 16, 0), (9, 11, 0), (17, 12, 0.8)]
        )
    ]
    want = run(build_engine(ds, overlap_schedule=False, **kw), jobs, stagger=2)
    eng = build_engine(ds, overlap_schedule=True, **kw)
    r = eng.runner
    r.builder.staging = ReusedStaging(r.device, r.builder.staging.dtype)
    max_pages = -(-min(eng.max_model_len, r.pool.capacity_tokens) // r.pool.page_size)
    with torch.inference_mode():
        r.graphs = without_capture(DecodeGraphs(r.model, r.backend, max_pages, 5))
    assert run(eng, jobs, stagger=2) == want
    assert r.graphs.replays > 0
