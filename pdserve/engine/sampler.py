"""The sampler: logits of a batch of requests -> one token each (and logprobs if asked).

Order of operations per row: penalties (repetition on prompt+output; frequency/presence on
output), min_tokens (EOS and stop ids masked), then greedy argmax (also for a temperature
below GREEDY_TEMPERATURE: dividing by it overflows), or temperature ->
top_k -> top_p -> min_p -> a draw. A seeded request draws from its own generator, so its
tokens do not depend on what else is in the batch. Logprobs are reported from the model's
raw distribution (before penalties and temperature), like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request, TokenLogprob


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> None:
    """In place, only for the rows whose request asks for a penalty."""
    for i, req in enumerate(reqs):
        p = req.params
        if not p.needs_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if req.output_ids and (p.frequency_penalty or p.presence_penalty):
            out = torch.tensor(req.output_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def apply_min_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> None:
    for i, req in enumerate(reqs):
        p = req.params
        if len(req.output_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
            if banned:
                idx = torch.tensor(sorted(banned), dtype=torch.long, device=logits.device)
                logits[i, idx] = float("-inf")


def filter_logits(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """top_k / top_p / min_p as a mask over each row's sorted distribution."""
    vocab = logits.shape[1]
    dev = logits.device
    # Clamped to the vocab: top_k may be up to 2**31 - 1, whatever this model's vocab is.
    top_k = torch.tensor([min(r.params.top_k, vocab) or vocab for r in reqs], device=dev)
    top_p = torch.tensor([r.params.top_p for r in reqs], device=dev, dtype=logits.dtype)
    min_p = torch.tensor([r.params.min_p for r in reqs], device=dev, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    ranks = torch.arange(vocab, device=dev)
    drop = ranks[None, :] >= top_k[:, None]
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw(probs: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """One token per row; seeded rows use their own generator (Gumbel/exponential race)."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        out[idx] = torch.multinomial(probs[idx], 1).squeeze(1)
    for i, r in enumerate(reqs):
        if r.generator is not None:
            noise = torch.empty(probs.shape[1], dtype=torch.float32).exponential_(
                generator=r.generator
            )
            out[i] = (probs[i].float().cpu() / noise).argmax()
    return out


def sample(
    logits: torch.Tensor, reqs: Sequence[Request]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [N, vocab] float32, one row per request -> (token ids, logprobs or None)."""
    raw_logprobs = (
        logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in reqs) else None
    )
    logits = logits.clone()
    apply_penalties(logits, reqs)
    apply_min_tokens(logits, reqs)
    tokens = logits.argmax(dim=-1)
    # A temperature under GREEDY_TEMPERATURE counts as greedy, so no row is divided by it.
    rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rand:
        sub_reqs = [reqs[i] for i in rand]
        idx = torch.tensor(rand, device=logits.device)
        temps = torch.tensor([r.params.temperature for r in sub_reqs], device=logits.device)
        sub = logits[idx] / temps[:, None]
        if any(r.params.needs_filtering for r in sub_reqs):
            sub = filter_logits(sub, sub_reqs)
        tokens[idx] = draw(sub.softmax(dim=-1), sub_reqs)
    ids = tokens.tolist()
    lps: list[TokenLogprob | None] = [None] * len(reqs)
    if raw_logprobs is not None:
        for i, r in enumerate(reqs):
            n = r.params.logprobs
            if n is None:
                continue
            row = raw_logprobs[i]
            top = row.topk(n) if n else None
            lps[i] = TokenLogprob(
                token_id=ids[i],
                logprob=float(row[ids[i]]),
                top=tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                if top
                else (),
            )
    return ids, lps
