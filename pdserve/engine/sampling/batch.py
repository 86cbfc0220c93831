"""One step's sampling parameters as tensors, gathered in one pass over the batch's requests.

Every feature (logit_bias and min_tokens bans, penalties, the draw and its filters, logprobs)
names the rows that use it, and only those rows pay for it; a feature no row uses is None.
A row's values never depend on the other rows: the rows of a subset are processed
independently and neutral values (top_k off, min_p 0) change nothing, bit for bit, so a row's
token is the same alone or in any batch (the isolation fallback and PD rely on it).

Host-side data goes to the device in two copies, one float64 and one int64 buffer, sliced
into views (`_Upload`); a float64 holds every value exactly (float params, 32-bit key
halves). The penalties upload every prompt and output id of their rows (`Penalties`: the
stateless `sample`), or, given the engine's `PenaltyState`, only the rows' slots and ids the
state has not seen yet (`SlotPenalties`: sampling/penalty_state.py).

Anything that would fail on the device (a token id past the logits' width) is refused here
first, as a ValueError naming the request: `isolation` then samples the rows alone and
fails only that one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling.penalty_state import PenaltyState, SlotPlan
from pdserve.engine.sampling.random_stream import row_key, split_key


class _Upload:
    """Flat host lists, one per dtype, uploaded in one copy each; named segments come back as
    device views."""

    def __init__(self) -> None:
        self.floats: list[float] = []
        self.ints: list[int] = []
        self.spans: dict[str, tuple[bool, int, int]] = {}

    def add(self, name: str, values: Sequence[float] | Sequence[int], is_float: bool) -> None:
        buf: list[float] | list[int] = self.floats if is_float else self.ints
        self.spans[name] = (is_float, len(buf), len(values))
        buf.extend(values)  # type: ignore[arg-type]

    def send(self, device: torch.device) -> dict[str, torch.Tensor]:
        # Pinned and non-blocking on CUDA: a pageable copy would wait for the step in flight
        # (overlapped scheduling); the pinned allocator keeps the buffer until the copy ran.
        pin = device.type == "cuda"
        f = torch.tensor(self.floats, dtype=torch.float64, pin_memory=pin and bool(self.floats))
        i = torch.tensor(self.ints, dtype=torch.int64, pin_memory=pin and bool(self.ints))
        f = f.to(device, non_blocking=True) if self.floats else f
        i = i.to(device, non_blocking=True) if self.ints else i
        return {
            name: (f if is_float else i).narrow(0, start, n)
            for name, (is_float, start, n) in self.spans.items()
        }


@dataclass(frozen=True)
class Sparse:
    """Per-(row, token) additions: logit_bias values, and -inf for tokens min_tokens bans."""

    rows: torch.Tensor  # [S] int64
    tokens: torch.Tensor  # [S] int64
    values: torch.Tensor  # [S] float32


@dataclass(frozen=True)
class Penalties:
    rows: torch.Tensor  # [P] int64, the rows with a penalty
    seen: torch.Tensor  # [P, L] int64 prompt + output ids, padded with vocab
    outputs: torch.Tensor  # [P, Lo] int64 output ids, padded with vocab
    repetition: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32


@dataclass(frozen=True)
class SlotPenalties:
    """The penalties read from the device state (sampling/penalty_state.py): a step uploads
    the rows' slots and scalars, and ids only to build a slot (a request's first penalised
    step) or to count tokens sampled elsewhere (`stage`)."""

    rows: torch.Tensor  # [P] int64, the rows with a penalty
    slots: torch.Tensor  # [P] int64, their rows of the state
    repetition: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32
    clear: torch.Tensor | None  # [C] int64 slots to zero first
    prompt: tuple[torch.Tensor, torch.Tensor] | None  # ([K], [K]) (slot, prompt id) to mark
    counts: tuple[torch.Tensor, torch.Tensor] | None  # ([K], [K]) (slot, output id) to count
    plan: SlotPlan


@dataclass(frozen=True)
class Draw:
    """The rows that draw a token (the others take the argmax), and their filters."""

    rows: torch.Tensor  # [R] int64
    temperature: torch.Tensor  # [R, 1] float32
    keys: torch.Tensor  # [R, 2] int64: random_stream keys of (seed, position)
    top_k: torch.Tensor | None  # [R, 1] int64 in [1, k_max], or None when no row uses it
    has_top_k: torch.Tensor | None  # [R, 1] bool
    k_max: int
    log_min_p: torch.Tensor | None  # [R, 1] float32, log(0) = -inf where off
    top_p_rows: torch.Tensor | None  # [Q] int64 indices into the R rows, those with top_p < 1
    top_p: torch.Tensor | None  # [Q, 1] float32


@dataclass(frozen=True)
class Logprobs:
    rows: torch.Tensor  # [M] int64, the rows that asked for logprobs
    host_rows: list[int]  # the same, on the host
    counts: list[int]  # top alternatives per such row


@dataclass(frozen=True)
class SamplingBatch:
    sparse: Sparse | None
    penalties: Penalties | SlotPenalties | None
    draw: Draw | None
    logprobs: Logprobs | None

    @classmethod
    def build(
        cls,
        reqs: Sequence[Request],
        vocab: int,
        device: torch.device,
        state: PenaltyState | None = None,
    ) -> SamplingBatch:
        """`reqs`' parameters for a step over logits of width `vocab`; ValueError naming the
        request for a token id that does not fit. With `state`, the penalties read it (the
        caller stages and commits `penalties.plan`, or abandons it); without, every
        penalised row's ids are uploaded."""
        if all(r.argmax_only for r in reqs):
            return cls(sparse=None, penalties=None, draw=None, logprobs=None)
        up = _Upload()
        has_sparse = _sparse(up, reqs, vocab)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        k_max = _draw(up, [reqs[i] for i in rand], vocab) if rand else 0
        any_min_p = any(reqs[i].params.min_p > 0 for i in rand)
        if rand:
            up.add("draw.rows", rand, is_float=False)
        lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp:
            up.add("lp.rows", lp, is_float=False)
        pen = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if not pen or state is None:
            if pen:
                _penalties(up, [reqs[i] for i in pen], vocab)
                _penalty_scalars(up, [reqs[i] for i in pen])
                up.add("pen.rows", pen, is_float=False)
            t = up.send(device)
            penalties: Penalties | SlotPenalties | None = (
                _make_penalties(t, len(pen)) if pen else None
            )
        else:  # the state's plan comes last: nothing on the host can fail after it
            plan = state.plan([reqs[i] for i in pen], vocab, device)
            try:
                _slot_lists(up, plan)
                _penalty_scalars(up, [reqs[i] for i in pen])
                up.add("pen.rows", pen, is_float=False)
                t = up.send(device)
                penalties = _slot(t, plan)
            except Exception:
                state.abandon(plan)
                raise
        return cls(
            sparse=_make_sparse(t) if has_sparse else None,
            penalties=penalties,
            draw=_make_draw(t, len(rand), k_max, any_min_p) if rand else None,
            logprobs=Logprobs(t["lp.rows"], lp, [reqs[i].params.logprobs or 0 for i in lp])
            if lp
            else None,
        )


def _sparse(up: _Upload, reqs: Sequence[Request], vocab: int) -> bool:
    """logit_bias, and -inf for the stop ids and EOS of rows still short of min_tokens; one
    entry per (row, token), a banned token's bias dropped (the ban wins either way). A row
    with a grammar has no bans: its grammar decides when it may end (sampling/grammars.py)."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, r in enumerate(reqs):
        p = r.params
        if not p.logit_bias and (not p.min_tokens or r.num_output_tokens >= p.min_tokens):
            continue  # nothing to add (most rows of most steps)
        add = dict(p.logit_bias)
        if r.num_output_tokens < p.min_tokens and not r.constrained:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            # An EOS id past the logits can never be sampled: nothing to ban.
            add.update((t, -math.inf) for t in banned if t < vocab or t in p.stop_token_ids)
        for t, v in sorted(add.items()):
            if not 0 <= t < vocab:
                raise ValueError(
                    f"request {r.request_id}: token id {t} (logit_bias or stop_token_ids) "
                    f"is outside the model's {vocab} logits"
                )
            rows.append(i)
            tokens.append(t)
            values.append(v)
    if not rows:
        return False
    up.add("sparse.rows", rows, is_float=False)
    up.add("sparse.tokens", tokens, is_float=False)
    up.add("sparse.values", values, is_float=True)
    return True


def _make_sparse(t: dict[str, torch.Tensor]) -> Sparse:
    return Sparse(t["sparse.rows"], t["sparse.tokens"], t["sparse.values"].float())


def _padded(seqs: list[list[int]], pad: int) -> list[int]:
    """Row-major [len(seqs), width] ids, each row padded with `pad` (width >= 1)."""
    width = max(1, max(len(s) for s in seqs))
    flat: list[int] = []
    for s in seqs:
        flat.extend(s)
        flat.extend([pad] * (width - len(s)))
    return flat


def _penalties(up: _Upload, reqs: list[Request], vocab: int) -> None:
    # Every output id must be on the host: this path (`sampler.sample`, the isolation
    # fallback, run after the step in flight was processed) has no state on the device.
    for r in reqs:
        if r.pending:
            raise RuntimeError(f"request {r.request_id}: penalties over a token still in flight")
    seen = _padded([r.all_ids for r in reqs], vocab)
    outs = _padded([r.output_ids for r in reqs], vocab)
    up.add("pen.seen", seen, is_float=False)
    up.add("pen.outputs", outs, is_float=False)


def _penalty_scalars(up: _Upload, reqs: list[Request]) -> None:
    scalars = [
        v
        for r in reqs
        for v in (
            r.params.repetition_penalty,
            r.params.frequency_penalty,
            r.params.presence_penalty,
        )
    ]
    up.add("pen.scalars", scalars, is_float=True)


def _slot_lists(up: _Upload, plan: SlotPlan) -> None:
    up.add("pen.slots", plan.slots, is_float=False)
    for name, values in (
        ("pen.clear", plan.clear),
        ("pen.prompt_at", plan.prompt_at),
        ("pen.prompt_ids", plan.prompt_ids),
        ("pen.count_at", plan.count_at),
        ("pen.count_ids", plan.count_ids),
    ):
        if values:
            up.add(name, values, is_float=False)


def _slot(t: dict[str, torch.Tensor], plan: SlotPlan) -> SlotPenalties:
    scalars = t["pen.scalars"].float().view(len(plan.slots), 3)
    return SlotPenalties(
        rows=t["pen.rows"],
        slots=t["pen.slots"],
        repetition=scalars[:, 0:1],
        frequency=scalars[:, 1:2],
        presence=scalars[:, 2:3],
        clear=t.get("pen.clear"),
        prompt=(t["pen.prompt_at"], t["pen.prompt_ids"]) if "pen.prompt_at" in t else None,
        counts=(t["pen.count_at"], t["pen.count_ids"]) if "pen.count_at" in t else None,
        plan=plan,
    )


def _make_penalties(t: dict[str, torch.Tensor], n: int) -> Penalties:
    scalars = t["pen.scalars"].float().view(n, 3)
    return Penalties(
        rows=t["pen.rows"],
        seen=t["pen.seen"].view(n, -1),
        outputs=t["pen.outputs"].view(n, -1),
        repetition=scalars[:, 0:1],
        frequency=scalars[:, 1:2],
        presence=scalars[:, 2:3],
    )


def _draw(up: _Upload, reqs: list[Request], vocab: int) -> int:
    """The drawing rows' parameters; returns k_max (0 when no row uses top_k)."""
    # top_k at or past the vocab keeps everything: it is off (top_k may be up to 2**31 - 1).
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in reqs]
    k_max = max(ks)
    scalars: list[float] = []
    for r, k in zip(reqs, ks, strict=True):
        lo, hi = split_key(row_key(r.seed, r.num_output_tokens))
        scalars += [r.params.temperature, r.params.min_p, float(k), float(lo), float(hi)]
    up.add("draw.scalars", scalars, is_float=True)
    top_p = [(j, r.params.top_p) for j, r in enumerate(reqs) if r.params.top_p < 1.0]
    if top_p:
        up.add("draw.top_p_rows", [j for j, _ in top_p], is_float=False)
        up.add("draw.top_p", [p for _, p in top_p], is_float=True)
    return k_max


def _make_draw(t: dict[str, torch.Tensor], n: int, k_max: int, any_min_p: bool) -> Draw:
    s = t["draw.scalars"].view(n, 5)
    min_p = s[:, 1:2].float()
    k = s[:, 2:3].long()
    has_p = "draw.top_p_rows" in t
    return Draw(
        rows=t["draw.rows"],
        temperature=s[:, 0:1].float(),
        keys=s[:, 3:5].long(),
        top_k=k.clamp(min=1) if k_max else None,
        has_top_k=k > 0 if k_max else None,
        k_max=k_max,
        log_min_p=min_p.log() if any_min_p else None,
        top_p_rows=t["draw.top_p_rows"] if has_p else None,
        top_p=t["draw.top_p"].float()[:, None] if has_p else None,
    )
