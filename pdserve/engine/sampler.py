"""The sampler: logits of a batch of requests -> one token each (and logprobs if asked).

All rows are processed together as tensor operations (pdserve/engine/sampling/): logit_bias
and the min_tokens bans (EOS and stop ids), the penalties, the grammar masks of the rows with
a structured-output constraint (sampling/grammars.py; none is computed when no row has one),
then the greedy argmax (also for a temperature below GREEDY_TEMPERATURE: dividing by it
overflows), or temperature -> min_p -> top_k -> top_p -> a Gumbel-max draw. A row's draw
reads only its own random stream, keyed by (seed, output position): the token at position i
is the same whichever worker samples it (a prefill worker samples position 0, a decode
worker the rest) and whatever else is batched with it. Every request has a seed
(`Request.seed`: the client's, or one drawn for it).

Logprobs are reported from the model's raw distribution (before bias, penalties, grammar and
temperature), like vLLM's default. The sampled ids, and the logprobs when some row asks for
them, come to the host in one device->host copy per step. `launch` queues all of it and
returns a `Sampled` whose `result` waits for that copy: under overlapped scheduling
(engine/inflight.py) the ids stay on the device as the next step's inputs while the CPU
prepares that step.

The engine samples through a `Sampler`, which keeps the penalties' counts on the device
(sampling/penalty_state.py): each launch adds its own draws there, so a penalised row reads
its history, tokens in flight included, without any upload. `sample` (and `launch` without a
state) is stateless: it uploads the ids from the host, for the row-by-row isolation fallback
and for tests; its logits are bit-identical to the Sampler's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.sampling.batch import Logprobs, Penalties, SamplingBatch, SlotPenalties
from pdserve.engine.sampling.grammar_mask import GrammarMask, apply_grammar_mask
from pdserve.engine.sampling.grammars import Grammars
from pdserve.engine.sampling.penalty_state import PenaltyState
from pdserve.engine.sampling.processors import (
    add_sparse,
    apply_penalties,
    apply_slot_penalties,
    draw,
    greedy,
)
from pdserve.runtime.gpu_wait import wait_event


def sample(
    logits: torch.Tensor, reqs: Sequence[Request], grammars: Grammars | None = None
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [N, vocab] (float32 or the model's dtype), one row per request -> (token ids,
    logprobs or None). `grammars`: the engine's, for rows with a constraint."""
    return launch(logits, reqs, grammars=grammars).result()


class Sampled:
    """A step's draws, launched on the device: `ids` [N] (int64, on the device: the next
    step's inputs under overlapped scheduling) and their copy to the host, in flight until
    `result` (the one device->host copy of the step; pinned and non-blocking on CUDA)."""

    def __init__(self, ids: torch.Tensor, flat: torch.Tensor, lp: Logprobs | None, n: int) -> None:
        self.ids = ids
        self._lp = lp
        self._n = n
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = flat, None

    def ready(self) -> bool:
        return self._copied is None or self._copied.query()

    def result(
        self, meanwhile: Callable[[], None] | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Waits for the copy (the step that sampled has then run), doing `meanwhile` between
        polls (runtime/gpu_wait.py), and decodes it."""
        if self._copied is not None:
            wait_event(self._copied, "a step's sampled ids", meanwhile=meanwhile)
        flat = self._host.tolist()
        if self._lp is None:
            return [int(t) for t in flat], [None] * self._n
        return _decode_logprobs(flat, self._n, self._lp)


class Sampler:
    """The engine's sampler: `launch`, with the penalties' state kept on the device from step
    to step (sampling/penalty_state.py), so a penalised row uploads no ids and needs none of
    the step in flight. `max_slots` (the engine's max_running) bounds the state's rows;
    `grammars` (the engine's) masks the rows with a constraint."""

    def __init__(self, max_slots: int, grammars: Grammars | None = None) -> None:
        self.penalties = PenaltyState(max_slots)
        self.grammars = grammars

    def launch(self, logits: torch.Tensor, reqs: Sequence[Request]) -> Sampled:
        return launch(logits, reqs, self.penalties, self.grammars)

    def sample(
        self, logits: torch.Tensor, reqs: Sequence[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Stateless (`sample`), with the grammars: the row-by-row isolation fallback."""
        return sample(logits, reqs, self.grammars)


def launch(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    state: PenaltyState | None = None,
    grammars: Grammars | None = None,
) -> Sampled:
    """Queue the sampling of `reqs` (one row of `logits` each) on the device; nothing waits.
    Without `state`, the penalties read every id from the host (none may be in flight).
    A constrained row needs `grammars`, and its matcher current (no token in flight)."""
    if not reqs:
        empty = torch.empty(0, dtype=torch.long, device=logits.device)
        return Sampled(empty, empty, None, 0)
    mask = None
    if any(r.constrained for r in reqs):  # the only grammar work of a step without one
        if grammars is None:
            raise RuntimeError("a constrained request sampled without the engine's grammars")
        mask = grammars.mask(reqs, logits.device)
    batch = SamplingBatch.build(reqs, logits.shape[1], logits.device, state)
    pen = batch.penalties
    if state is None or not isinstance(pen, SlotPenalties):
        return _sample_batch(logits, reqs, batch, state, mask)
    try:
        state.stage(pen.clear, pen.prompt, pen.counts)
        sampled = _sample_batch(logits, reqs, batch, state, mask)
        state.count(pen.slots, sampled.ids.index_select(0, pen.rows))  # in flight: counted
    except Exception:
        state.abandon(pen.plan)
        raise
    state.commit(pen.plan)
    return sampled


def _sample_batch(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    batch: SamplingBatch,
    state: PenaltyState | None,
    mask: GrammarMask | None,
) -> Sampled:
    raw = None
    if batch.logprobs is not None:
        raw = logits.index_select(0, batch.logprobs.rows).float().log_softmax(dim=-1)  # [M, V]
    pen = batch.penalties
    if batch.sparse is not None or pen is not None or mask is not None:
        # a float32 copy: the caller's logits stay as the model produced them
        logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
        if batch.sparse is not None:
            add_sparse(logits, batch.sparse)
        if isinstance(pen, Penalties):
            apply_penalties(logits, pen)
        elif pen is not None:
            if state is None:
                raise RuntimeError("slot penalties without their state")
            apply_slot_penalties(logits, pen, state)
        if mask is not None:
            apply_grammar_mask(logits, mask)
    ids = greedy(logits)  # [N]
    if batch.draw is not None:
        picks = draw(logits.index_select(0, batch.draw.rows).float(), batch.draw)
        ids.index_copy_(0, batch.draw.rows, picks)
    if raw is None or batch.logprobs is None:
        return Sampled(ids, ids, None, len(reqs))
    return Sampled(ids, _logprob_parts(ids, raw, batch.logprobs), batch.logprobs, len(reqs))


def _logprob_parts(ids: torch.Tensor, raw: torch.Tensor, lp: Logprobs) -> torch.Tensor:
    """The ids and each asking row's logprob and top alternatives as one float64 buffer
    (token ids below 2**53 are exact in it): [ids | chosen | top values | top indices]."""
    k = max(lp.counts)
    chosen = raw.gather(1, ids.index_select(0, lp.rows)[:, None])  # [M, 1]
    parts = [ids.double(), chosen.double().flatten()]
    if k:
        top = raw.topk(k, dim=-1)  # [M, k] descending
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    return torch.cat(parts)


def _decode_logprobs(
    flat: list[float], n: int, lp: Logprobs
) -> tuple[list[int], list[TokenLogprob | None]]:
    m, k = len(lp.host_rows), max(lp.counts)
    tokens = [int(t) for t in flat[:n]]
    values = flat[n + m : n + m + m * k]
    indices = flat[n + m + m * k :]
    out: list[TokenLogprob | None] = [None] * n
    for j, (row, count) in enumerate(zip(lp.host_rows, lp.counts, strict=True)):
        top_j = [(int(indices[j * k + c]), values[j * k + c]) for c in range(count)]
        out[row] = TokenLogprob(token_id=tokens[row], logprob=flat[n + j], top=tuple(top_j))
    return tokens, out
