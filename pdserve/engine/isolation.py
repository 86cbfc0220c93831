"""Isolating a failure inside a batched step to the requests it belongs to (LESSONS #16).

A step runs one forward over every scheduled chunk and samples every row at once. When
either raises, the engine does not fail the whole batch: it runs the forward again one chunk
at a time, or samples one row at a time, and fails only the requests that raise alone. The
others go on with the tokens they would have had: a chunk's KV and logits do not depend on
the other chunks of its batch, and a row's draw is a pure function of its logits, its
params and its (seed, output position) (engine/sampling/): sampling has no state to rewind.

Rerunning a chunk rewrites the KV slots the failed forward may have written, with the same
values, so nothing half-written survives. Per-request state (DeepSeek-V4), which a step
rewrites rather than appends to, is put back as it was before the failed forward
(attention/v4_kv.py's journal, undone by `ModelRunner.forward`), so a rerun reads what the
first attempt read. Both paths cost a forward or a sample per chunk:
they are for the rare failure, never the normal step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.inflight import Feed, Picks
from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Chunk
from pdserve.parallel.lockstep import LockstepError

log = logging.getLogger(__name__)

Fail = Callable[[Request, str], None]
Sampler = Callable[[torch.Tensor, Sequence[Request]], tuple[list[int], list[TokenLogprob | None]]]


def forward_each(
    runner: ModelRunner, chunks: Sequence[Chunk], fail: Fail, feed: Feed | None = None
) -> tuple[torch.Tensor, list[Chunk]]:
    """Run each chunk alone; fail those that raise. Returns the survivors' logits (one row per
    survivor that samples, in order) and the surviving chunks. `feed`: the step in flight's
    sampled ids (engine/inflight.py)."""
    rows: list[torch.Tensor] = []
    kept: list[Chunk] = []
    for c in chunks:
        try:
            logits = runner.forward([c], feed)
        except LockstepError:
            raise  # the tensor-parallel group's end, no chunk's fault (engine/stepper.py)
        except Exception as e:  # noqa: BLE001 - this chunk is at fault: its request fails
            log.warning("request %s: its chunk fails alone: %s", c.request.request_id, e)
            fail(c.request, f"the model failed on this request: {type(e).__name__}: {e}")
            continue
        kept.append(c)
        rows.append(logits)
    vocab = runner.model.arch.vocab_size
    if not rows:
        return torch.empty(0, vocab, dtype=torch.float32, device=runner.device), kept
    return torch.cat(rows), kept


def sample_each(
    sample: Sampler, logits: torch.Tensor, reqs: Sequence[Request], fail: Fail
) -> Picks:
    """Sample each row alone; fail the requests whose row raises. Returns the others' picks."""
    picked: Picks = []
    for i, req in enumerate(reqs):
        try:
            (tok,), (lp,) = sample(logits[i : i + 1], [req])
        except Exception as e:  # noqa: BLE001 - this row is at fault: its request fails
            log.warning("request %s: its row fails to sample alone: %s", req.request_id, e)
            fail(req, f"sampling failed for this request: {type(e).__name__}: {e}")
            continue
        picked.append((req, tok, lp))
    return picked
