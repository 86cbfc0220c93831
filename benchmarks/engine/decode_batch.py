"""A batch of requests brought to decoding in an engine, for the decode-step benchmarks
(engine/gpu_decode.py, engine/deepseek_decode.py): the prompts prefilled (or warmed through the
prefix cache, so that the batch starts as one step of decodes), and the next step's chunks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdserve.engine.engine import Engine
from pdserve.engine.request import RequestOutput
from pdserve.engine.scheduler import Chunk
from pdserve.protocol.sampling import SamplingParams

PREFILL_TIMEOUT_S = 600.0


def prefill(
    engine: Engine,
    batch: int,
    ctx: int,
    max_tokens: int,
    ended: dict[str, str],
    warm: bool = False,
) -> list[str]:
    """Submit `batch` random `ctx`-token prompts and tick until each has its first token (so
    each is decoding: its KV holds the prompt); returns their ids. A request that ends is
    entered in `ended` (id -> why): none should before the benchmark aborts them.

    `warm`: each prompt's first ctx - 1 tokens (whole pages) are computed first, by requests
    that end at their first token, in steps of prefill chunks only; the batch's requests then
    start from the prefix cache with one token each to compute, all in one step of decodes.
    So no step mixes the batch's decodes with a long chunk: a model whose mixed steps grow
    with every sequence in them (DeepSeek's expanded MLA: each sequence's context expanded to
    every head) needs that at a large batch."""
    vocab = min(engine.model.arch.vocab_size, 4000)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, ctx), generator=g).tolist()
    if warm:
        page = engine.pool.page_size
        if engine.scheduler.cache is None or (ctx - 1) % page:
            raise ValueError(
                f"a warm prefill needs the prefix cache and ctx - 1 in whole pages of {page} "
                f"tokens, got ctx {ctx}"
            )
        once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        warming: dict[str, str] = {}
        for i, prompt in enumerate(prompts):

            def warmed(out: RequestOutput, rid: str = f"w{batch}-{i}") -> None:
                if out.finish_reason is not None:
                    warming[rid] = f"{out.finish_reason}: {out.error}"

            engine.submit(f"w{batch}-{i}", prompt[:-1], once, warmed)
        tick_until(engine, lambda: len(warming) == batch, f"warm prefill of {batch} prompts")
        failed = {rid: why for rid, why in warming.items() if not why.startswith("length")}
        if failed:
            raise RuntimeError(f"warm prefill failed: {failed}")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    got: set[str] = set()
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts, strict=True):

        def sink(out: RequestOutput, rid: str = rid) -> None:
            if out.finish_reason is not None:
                ended[rid] = f"{out.finish_reason}: {out.error}"
            got.add(rid)

        engine.submit(rid, prompt, params, sink)
    tick_until(engine, lambda: len(got) == batch or bool(ended), f"prefill of {batch} prompts")
    return ids


def tick_until(engine: Engine, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PREFILL_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} unfinished after {PREFILL_TIMEOUT_S}s")
        engine.tick()


def check_none_ended(ended: dict[str, str]) -> None:
    if ended:
        raise RuntimeError(f"{len(ended)} requests ended early, e.g. {next(iter(ended.items()))}")


def decode_chunks(engine: Engine, ids: list[str]) -> list[Chunk]:
    """The engine's next step, as its scheduler plans it (pages for the new tokens included):
    one decode chunk per request. Planning twice changes nothing, so the engine's own next
    tick plans the same step again."""
    plan = engine.scheduler.schedule()
    if plan.preempted or sorted(c.request.request_id for c in plan.chunks) != sorted(ids):
        raise RuntimeError(f"the next step is not a decode of each of the {len(ids)} requests")
    if any(c.length != 1 or not c.samples for c in plan.chunks):
        raise RuntimeError("a request is not decoding after its prefill")
    return plan.chunks
