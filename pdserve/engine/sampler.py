"""The sampler: logits of a batch of requests -> one token each (and logprobs if asked).

All rows are processed together as tensor operations (pdserve/engine/sampling/): logit_bias
and the min_tokens bans (EOS and stop ids), the penalties, then the greedy argmax (also for a
temperature below GREEDY_TEMPERATURE: dividing by it overflows), or temperature -> min_p ->
top_k -> top_p -> a Gumbel-max draw. A row's draw reads only its own random stream, keyed by
(seed, output position): the token at position i is the same whichever worker samples it (a
prefill worker samples position 0, a decode worker the rest) and whatever else is batched
with it. Every request has a seed (`Request.seed`: the client's, or one drawn for it).

Logprobs are reported from the model's raw distribution (before bias, penalties and
temperature), like vLLM's default. The sampled ids, and the logprobs when some row asks for
them, come to the host in one device->host copy per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.sampling.batch import Logprobs, SamplingBatch
from pdserve.engine.sampling.processors import add_sparse, apply_penalties, draw


def sample(
    logits: torch.Tensor, reqs: Sequence[Request]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [N, vocab] float32, one row per request -> (token ids, logprobs or None)."""
    if not reqs:
        return [], []
    batch = SamplingBatch.build(reqs, logits.shape[1], logits.device)
    raw = None
    if batch.logprobs is not None:
        raw = logits.index_select(0, batch.logprobs.rows).log_softmax(dim=-1)  # [M, V]
    if batch.sparse is not None or batch.penalties is not None:
        logits = logits.clone()  # the caller's logits stay as the model produced them
        if batch.sparse is not None:
            add_sparse(logits, batch.sparse)
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
    ids = logits.argmax(dim=-1)  # [N]
    if batch.draw is not None:
        picks = draw(logits.index_select(0, batch.draw.rows), batch.draw)
        ids.index_copy_(0, batch.draw.rows, picks)
    if raw is None or batch.logprobs is None:
        return ids.tolist(), [None] * len(reqs)
    return _with_logprobs(ids, raw, batch.logprobs)


def _with_logprobs(
    ids: torch.Tensor, raw: torch.Tensor, lp: Logprobs
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The ids and each asking row's logprob and top alternatives, in one device->host copy
    (one float64 buffer: token ids below 2**53 are exact in it)."""
    n, m, k = ids.shape[0], raw.shape[0], max(lp.counts)
    chosen = raw.gather(1, ids.index_select(0, lp.rows)[:, None])  # [M, 1]
    parts = [ids.double(), chosen.double().flatten()]
    if k:
        top = raw.topk(k, dim=-1)  # [M, k] descending
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    flat = torch.cat(parts).tolist()
    tokens = [int(t) for t in flat[:n]]
    values = flat[n + m : n + m + m * k]
    indices = flat[n + m + m * k :]
    out: list[TokenLogprob | None] = [None] * n
    for j, (row, count) in enumerate(zip(lp.host_rows, lp.counts, strict=True)):
        top_j = [(int(indices[j * k + c]), values[j * k + c]) for c in range(count)]
        out[row] = TokenLogprob(token_id=tokens[row], logprob=flat[n + j], top=tuple(top_j))
    return tokens, out
