"""Tensor-parallel ranks for tests: spawned processes over gloo on 127.0.0.1, and the jobs they
run, the same code the parent runs at TP 1 for its reference.

`spawn` starts `world` processes (torch.multiprocessing, spawn), each joining one process group
and running a list of jobs (`JOBS`, by name) on it; each rank writes its results, or its
traceback, to a file. Every process is joined within a deadline and killed by its pid after
it, whatever happened; a rank's error is raised in the parent with its traceback.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from pdserve.attention.backend import AttentionContext
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.model.loader import load_model
from pdserve.parallel.dp_tokens import DpTokens
from pdserve.parallel.group import RankGroup
from pdserve.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.protocol.sampling import SamplingParams

HOST = "127.0.0.1"
CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def spawn(
    world: int, jobs: list[tuple[str, tuple[Any, ...]]], tmp: Path, timeout_s: float = 60.0,
    group_timeout_s: float = 60.0,
) -> list[list[Any]]:  # fmt: skip
    """Run `jobs` in order on `world` ranks; [rank][job] results. Raises AssertionError naming
    the rank whose job failed (its traceback) or that left nothing by the deadline."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, world, port, str(tmp), jobs, group_timeout_s),
            daemon=True,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL to its pid
                p.join(5.0)
    out = []
    for r, p in enumerate(procs):
        f = tmp / f"rank{r}.pt"
        if not f.exists():
            raise AssertionError(f"rank {r} of {world} left no result (exit code {p.exitcode})")
        got = torch.load(f, weights_only=True)
        if "error" in got:
            raise AssertionError(f"rank {r} of {world} failed:\n{got['error']}")
        out.append(got["results"])
    return out


def rank_main(
    rank: int,
    world: int,
    port: int,
    tmp: str,
    jobs: list[tuple[str, tuple[Any, ...]]],
    group_timeout_s: float,
) -> None:
    """One spawned rank: join the group, run the jobs, write rank{r}.pt."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections on the loopback only
    torch.set_num_threads(1)  # several ranks share a small machine
    out: dict[str, Any]
    try:
        group = RankGroup.init(
            rank, world, host=HOST, port=port, backend="gloo", timeout_s=group_timeout_s
        )
        try:
            out = {"results": [JOBS[name](group, *args) for name, args in jobs]}
        finally:
            group.close()
    except Exception:  # noqa: BLE001 - any failure goes to the parent, with its traceback
        out = {"error": traceback.format_exc()}
    torch.save(out, Path(tmp) / f"rank{rank}.pt")


# ---------------------------------------------------------------- the model through paged KV

PAGE = 4  # small pages: every sequence spans several, its last one partly filled
PAGES = 64
PROMPT_LENS = (5, 17, 33)
LONG = 40  # a prompt prefilled in two chunks, the second over the first's KV
FIRST_CHUNK = 24


def forward_steps(path: Path, group: RankGroup) -> dict[str, Any]:
    """Two steps of the model through its rank's KV pool and the torch backend's paged
    attention, with every row's logits ("logits": float32 [T, vocab] of each step): prefills
    of three prompts and a first chunk of a fourth; then a decode of each of the three and the
    fourth's second chunk, reading the KV the first step stored. "heads": the rank's query and
    KV heads, and the KV heads a token's page row holds."""
    model = load_model(path, torch.float32, CPU, group)
    layout = KVLayout.for_model(
        model.arch, "float32", PAGE, tp_rank=group.rank, tp_size=group.world_size
    )
    runner = ModelRunner(model, KVPool(layout, PAGES, CPU), "torch")
    gen = torch.Generator().manual_seed(1)
    vocab = model.arch.vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    long = torch.randint(vocab, (LONG,), generator=gen).tolist()
    nexts = torch.randint(vocab, (len(prompts),), generator=gen).tolist()
    free = iter(range(1, PAGES))  # page 0 pads the page table
    names = iter(range(100))

    def request(ids: list[int], pages: list[int] | None = None) -> Request:
        req = Request(f"r{next(names)}", ids, SamplingParams(), lambda out: None)
        req.pages = pages or [next(free) for _ in range(-(-(len(ids) + 1) // PAGE))]
        return req

    first = [request(p) for p in prompts]
    whole = request(long)
    step1 = [Chunk(r, 0, len(p)) for r, p in zip(first, prompts, strict=True)]
    step1.append(Chunk(whole, 0, FIRST_CHUNK))
    step2 = [
        Chunk(request(p + [t], r.pages), len(p), 1)
        for p, t, r in zip(prompts, nexts, first, strict=True)
    ]
    step2.append(Chunk(whole, FIRST_CHUNK, LONG - FIRST_CHUNK))
    heads = [model.arch.num_heads, model.arch.num_kv_heads, layout.num_kv_heads]
    return {"logits": [_all_logits(runner, step1), _all_logits(runner, step2)], "heads": heads}


@torch.inference_mode()
def _all_logits(runner: ModelRunner, chunks: list[Chunk]) -> torch.Tensor:
    batch = runner.build(chunks)
    ctx = AttentionContext(runner.backend, runner.backend.prepare(batch))
    hidden = runner.model(batch.input_ids, batch.positions, ctx)  # [T, hidden]
    return runner.model.compute_logits(hidden)  # [T, vocab]


# ---------------------------------------------------------------- each layer against torch's

HEAD_DIM, Q_HEADS, KV_HEADS = 4, 8, 2
HIDDEN, VOCAB, ROWS = 16, 11, 5  # a vocab that no group of 2, 3 or 4 ranks splits evenly


def layer_weights() -> dict[str, torch.Tensor]:
    """The whole layers' weights and inputs, the same on every rank and in the parent."""
    g = torch.Generator().manual_seed(7)
    q, kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    return {
        "x": randn(ROWS, HIDDEN),
        "qkv.weight": randn(q + 2 * kv, HIDDEN),
        "qkv.bias": randn(q + 2 * kv),
        "o.x": randn(ROWS, q),
        "o.weight": randn(HIDDEN, q),
        "o.bias": randn(HIDDEN),
        "embed.weight": randn(VOCAB, HIDDEN),
        "ids": torch.tensor([0, 10, 5, 6, 3, 9, 1]),
    }


def layers(group: RankGroup) -> dict[str, torch.Tensor]:
    """Each parallel layer, loaded from the whole weights as the loader does, on this rank:
    the column layer's local output, the others' whole outputs."""
    w = layer_weights()
    q, kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    parts = (Part(q, Q_HEADS), Part(kv, KV_HEADS), Part(kv, KV_HEADS))
    qkv = ColumnParallelLinear(HIDDEN, parts, True, group, replicate=True)
    for name in ("weight", "bias"):  # q, k and v one by one, as the fused plan places them
        for start, size in ((0, q), (q, kv), (q + kv, kv)):
            qkv.load_shard(name, w[f"qkv.{name}"][start : start + size], start)
    o = RowParallelLinear(q, HIDDEN, True, group, units=Q_HEADS)
    o.load_shard("weight", w["o.weight"])
    o.load_shard("bias", w["o.bias"])
    mine = o.shards["weight"].runs[0]  # this rank's input columns
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, group)
    embed.load_shard("weight", w["embed.weight"])
    head = ParallelLMHead(HIDDEN, VOCAB, group)
    head.weight = embed.weight  # tied
    with torch.no_grad():
        return {
            "qkv": qkv(w["x"]),
            "o": o(w["o.x"][:, mine.whole : mine.whole + mine.length].contiguous()),
            "embed": embed(w["ids"]),
            "head": head(w["x"]),
        }


def dp_counts(world: int) -> list[int]:
    """Data-parallel rows per rank: uneven, and rank 1 idle."""
    return [0 if r == 1 else r + 2 for r in range(world)]


def dp_rows(rank: int, n: int, salt: int) -> torch.Tensor:
    """Rank `rank`'s n rows of width 3, different for every rank and salt."""
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * rank + salt


def dp_exchange(group: RankGroup) -> dict[str, torch.Tensor]:
    """parallel/dp_tokens.py: every rank's rows gathered, then each rank's partial results of
    every row summed, this rank's rows kept."""
    dp = DpTokens(group)
    counts = dp_counts(group.world_size)
    dp.begin(counts)
    every = dp.gather(dp_rows(group.rank, counts[group.rank], 0))
    partial = dp_rows(group.rank, sum(counts), 7)  # this rank's share of every row's result
    return {"gathered": every, "own": dp.own_sum(partial)}


def stall(group: RankGroup, stall_s: float) -> list[Any]:
    """Rank 0 sums; the others never join: rank 0's error and how long it waited."""
    if group.rank != 0:
        time.sleep(stall_s)
        return []
    t0 = time.monotonic()
    try:
        group.all_reduce_sum(torch.ones(3))
    except RuntimeError as e:
        return [type(e).__name__, str(e), time.monotonic() - t0]
    return ["no error", "", time.monotonic() - t0]


JOBS: dict[str, Callable[..., Any]] = {
    "forward": lambda group, path: forward_steps(Path(path), group),
    "layers": layers,
    "stall": stall,
    "dp_exchange": dp_exchange,
}
