"""The logits processors: batched tensor operations over the rows of a SamplingBatch feature.

Order (as vLLM's): logit_bias and min_tokens bans, then the penalties, then (drawing rows
only) temperature, min_p, top_k, top_p and the race. Each step is exact for a row it does not
concern (neutral values, or the row is not in the subset), so no row depends on its batch.

- Repetition penalty (on prompt + output ids, as a set): a seen token's logit is divided by
  the penalty when positive and multiplied by it otherwise.
- Frequency / presence (on output ids): logit -= frequency * count + presence * (count > 0).
  The ids come either as this step's upload (`apply_penalties`: the stateless `sample`) or as
  rows of the device state (`apply_slot_penalties`: sampling/penalty_state.py); both run the
  same arithmetic on the same integers, so their logits are bit-identical.
- min_p keeps the tokens whose probability is at least min_p times the largest one, i.e.
  z >= max(z) + log(min_p); top_k keeps the tokens whose logit is at least the k-th largest
  (ties at the k-th value all stay); top_p then keeps the smallest prefix, in a stable
  descending order (ties by token id), of the distribution renormalised over what min_p and
  top_k kept, whose mass reaches top_p.
- The draw: argmax(z + g) over the kept tokens, g the row's Gumbel noise from its
  (seed, position) key: the Gumbel-max trick, which picks token i with probability
  softmax(z)_i.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampling.batch import Draw, Penalties, SlotPenalties, Sparse
from pdserve.engine.sampling.penalty_state import PenaltyState
from pdserve.engine.sampling.random_stream import gumbel_noise

NEG_INF = float("-inf")


def add_sparse(logits: torch.Tensor, sparse: Sparse) -> None:
    """In place: logits[row, token] += value, each (row, token) at most once (so the result
    does not depend on the order of additions)."""
    logits.index_put_((sparse.rows, sparse.tokens), sparse.values, accumulate=True)


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    """In place, on the penalised rows of logits [N, V], from the ids uploaded this step."""
    vocab = logits.shape[1]
    p = pen.rows.shape[0]
    # Column `vocab` catches the padding; it is dropped again.
    seen = torch.zeros(p, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, pen.seen, True)
    counts = torch.zeros(p, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, pen.outputs, torch.ones_like(pen.outputs, dtype=logits.dtype))
    _penalise(logits, pen.rows, seen[:, :vocab], counts[:, :vocab], pen)


def apply_slot_penalties(logits: torch.Tensor, pen: SlotPenalties, state: PenaltyState) -> None:
    """In place, on the penalised rows of logits [N, V], from the device state (staged)."""
    seen, counts = state.rows(pen.slots)  # [P, V] bool, [P, V] float32
    _penalise(logits, pen.rows, seen, counts, pen)


def _penalise(
    logits: torch.Tensor,
    rows: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    pen: Penalties | SlotPenalties,
) -> None:
    """The arithmetic both paths share (so they agree bit for bit): seen [P, V] bool (prompt
    or output), counts [P, V] of the logits' dtype (output counts, exact integers)."""
    sub = logits.index_select(0, rows)  # [P, V]
    sub = torch.where(seen, torch.where(sub > 0, sub / pen.repetition, sub * pen.repetition), sub)
    sub = sub - (pen.frequency * counts + pen.presence * (counts > 0).to(sub.dtype))
    logits.index_copy_(0, rows, sub)


def filter_min_p_top_k(z: torch.Tensor, d: Draw) -> None:
    """In place on the drawing rows' scaled logits z [R, V]: min_p, then top_k."""
    if d.log_min_p is not None:
        keep_from = z.max(dim=-1, keepdim=True).values + d.log_min_p  # -inf where min_p = 0
        z.masked_fill_(z < keep_from, NEG_INF)
    if d.top_k is not None and d.has_top_k is not None:
        top = z.topk(d.k_max, dim=-1).values  # [R, k_max], descending
        kth = top.gather(1, d.top_k - 1)
        kth = torch.where(d.has_top_k, kth, NEG_INF)
        z.masked_fill_(z < kth, NEG_INF)


def filter_top_p(z: torch.Tensor, d: Draw) -> None:
    """In place on z [R, V], for the rows with top_p < 1 only."""
    if d.top_p_rows is None or d.top_p is None:
        return
    sub = z.index_select(0, d.top_p_rows)  # [Q, V]
    ordered, order = sub.sort(dim=-1, descending=True, stable=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    ordered.masked_fill_(before >= d.top_p, NEG_INF)  # the first token always stays
    z.index_copy_(0, d.top_p_rows, sub.scatter_(1, order, ordered))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64: each row's argmax, as torch's (the first greatest; NaN counts
    greatest). On CUDA two small Triton kernels (sampling/triton_argmax.py says why torch's is
    slow there); a 16-bit row gives the pick its float32 copy would."""
    if (
        logits.is_cuda
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and logits.stride(-1) == 1
        and logits.shape[-1] > 0
    ):
        from pdserve.engine.sampling.triton_argmax import argmax

        return argmax(logits)
    return logits.argmax(dim=-1)


def draw(logits: torch.Tensor, d: Draw) -> torch.Tensor:
    """The drawing rows' logits [R, V] (penalised, not yet scaled) -> [R] int64 token ids."""
    z = logits / d.temperature
    filter_min_p_top_k(z, d)
    filter_top_p(z, d)
    if z.is_cuda:  # one kernel: the noise never leaves registers (sampling/triton_draw.py)
        from pdserve.engine.sampling.triton_draw import gumbel_argmax

        return gumbel_argmax(z, d.keys)
    z += gumbel_noise(d.keys, z.shape[1])
    return z.argmax(dim=-1)
