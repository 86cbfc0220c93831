"""Prompt logprobs (params.prompt_logprobs): which rows of a step's hidden states are scored, and
their scores.

For the chunks of requests that ask, and only for those rows, each prompt position is scored
against the next prompt token, in float32 log_softmax, PROMPT_LOGPROB_ROWS rows at a time (a
long prompt chunk's [rows, vocab] buffer stays bounded). The runner (engine/runner.py) appends
the scores to each request (Request.prompt_logprobs) only after the whole step's scoring
succeeded: a step that raises leaves none behind, and a recomputed chunk (preemption) adds none
twice. `model.compute_logits` is the LM head: a collective at TP > 1 for a vocab-parallel head,
so a follower runs it on the leader's rows too (`row_logprobs`); with data-parallel attention
only the leader runs it, on every rank's gathered rows (engine/runner.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.scheduler import Chunk
from pdserve.model.loader import LoadedModel

# Prompt rows scored at once: bounds the [rows, vocab] float32 buffer of a long prompt chunk.
PROMPT_LOGPROB_ROWS = 512


class PromptRows(NamedTuple):
    """A step's prompt rows to score: rows of the hidden states, the next prompt token of
    each, and whose they are (request, its rows, its top count), in order."""

    rows: list[int]
    targets: list[int]
    owners: list[tuple[Request, int, int]]


def prompt_rows(chunks: Sequence[Chunk], bases: Sequence[int]) -> PromptRows:
    """The rows of the step's hidden states whose prompt tokens are scored (`bases`: each
    chunk's first row): hidden row of position p -> prompt token p + 1, for each asking
    request, the positions it has no score of yet."""
    rows: list[int] = []  # rows of `hidden`
    targets: list[int] = []  # the next prompt token of each row
    owners: list[tuple[Request, int, int]] = []  # (request, its rows, its top count)
    for c, first_row in zip(chunks, bases, strict=False):
        req, top_n = c.request, c.request.params.prompt_logprobs
        if top_n is None:
            continue
        first = max(c.start, len(req.prompt_logprobs))  # positions before are scored
        end = min(c.start + c.length, len(req.prompt_ids) - 1)
        if first >= end:
            continue
        base = first_row - c.start
        rows.extend(range(base + first, base + end))
        targets.extend(req.prompt_ids[first + 1 : end + 1])
        owners.append((req, end - first, top_n))
    return PromptRows(rows, targets, owners)


def score_prompts(model: LoadedModel, asked: PromptRows, hidden: torch.Tensor) -> None:
    """Append to each asking request the scores of the prompt tokens its chunk predicts: the
    logprob of the next prompt token and the top alternatives."""
    rows, targets, owners = asked
    if not rows:
        return
    k = max(n for _, _, n in owners)
    scored: list[TokenLogprob] = []
    for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
        scored += _score_rows(
            model,
            hidden,
            rows[s : s + PROMPT_LOGPROB_ROWS],
            targets[s : s + PROMPT_LOGPROB_ROWS],
            k,
        )
    at = 0
    for req, count, top_n in owners:
        for x in scored[at : at + count]:
            req.prompt_logprobs.append(TokenLogprob(x.token_id, x.logprob, x.top[:top_n]))
        at += count


def _score_rows(
    model: LoadedModel, hidden: torch.Tensor, rows: list[int], targets: list[int], k: int
) -> list[TokenLogprob]:
    """One slice of rows, in one device->host copy (float64: ids below 2**53 are exact)."""
    tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    lp = row_logprobs(model, hidden, rows)
    parts = [lp.gather(1, tgt[:, None]).double().flatten()]
    if k:
        top = lp.topk(k, dim=-1)  # [R, k] descending
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    flat = torch.cat(parts).tolist()
    r = len(rows)
    values, indices = flat[r : r + r * k], flat[r + r * k :]
    return [
        TokenLogprob(
            targets[j],
            flat[j],
            tuple((int(indices[j * k + c]), values[j * k + c]) for c in range(k)),
        )
        for j in range(r)
    ]


def row_logprobs(model: LoadedModel, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """float32 log_softmax [R, vocab] of `rows` of `hidden`."""
    idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    return model.compute_logits(hidden.index_select(0, idx)).float().log_softmax(dim=-1)
