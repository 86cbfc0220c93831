"""An engine whose forward is only the batch build: the engine's host work, on any machine.

`stub_forward(engine)` replaces the runner's forward by the step's batch build (the engine's
work: kept) and a fixed block of logits of a small vocabulary (the sampler's tensor work stays
small and fixed), so a benchmark times scheduling, the build, the sampler's launch and the
tokens' processing, and no model. Used by engine_overhead.py (decodes only) and engine_load.py
`--stub-forward` (a serving load: arrivals, prefill chunks, finishes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.engine import Engine
from pdserve.engine.inflight import Feed
from pdserve.engine.scheduler import Chunk

VOCAB = 64  # the stub's logits


def stub_forward(engine: Engine, vocab: int = VOCAB) -> None:
    """From now on `engine`'s forward builds the batch and returns zero logits [N, vocab]."""
    runner = engine.runner
    logits = torch.zeros(max(1, engine.cfg.scheduler.max_running), vocab)

    def forward(chunks: Sequence[Chunk], feed: Feed | None = None) -> torch.Tensor:
        runner.build(chunks, feed)
        n = sum(1 for c in chunks if c.samples)
        if n > logits.shape[0]:
            return torch.zeros(n, vocab)
        return logits[:n]

    runner.forward = forward  # type: ignore[method-assign]
