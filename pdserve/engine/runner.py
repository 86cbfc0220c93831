"""The model runner: a step's chunks -> one Batch -> the backend's metadata -> logits.

The Batch (pdserve/attention/batch.py) is built on the host once per step and reaches the
device in one staged copy; decodes go to it as columns, and each request keeps its page-table
row from step to step (attention/page_table.py) until `release` (Engine.finish). The attention
backend derives its own metadata from it once, and every layer reuses that. The model sees
only tokens, positions and an AttentionContext. On CUDA, with graphs on and a backend that
supports them, a step replays a captured graph instead: a decode graph for a step of decodes
(engine/cuda_graphs.py), a prefill graph for a step that carries prefill chunks, its decodes
included (engine/prefill_graphs.py); a step that a captured bucket does not hold runs eagerly.
Either way the forward yields hidden states [T, hidden] for the step's tokens, and the LM head
and prompt scoring read the rows they need.

Prompt logprobs (params.prompt_logprobs): for the chunks of requests that ask, the forward also
scores those rows (engine/prompt_scoring.py).

Tensor parallelism (`leader`, engine/tp_leader.py): every forward is a chain of collectives
(the LM head's all-gather included, prompt scoring's too), so rank 0's runner hands the
leader each step's plan, its sequences as plain spans and its rows to score
(parallel/step_record.py), after the Batch is built and before the model runs, and a
follower's runner runs exactly that (`follow`): the same Batch from its own builder, the same
forward, the same LM head calls. A build that raises has sent nothing, so the step's chunks may
still run one by one (engine/isolation.py), each its own record; once a record is sent, a raise
is the group's end (`Leader.lost`), never a retry. At TP 1 there is no leader and nothing here
touches torch.distributed.

Data-parallel attention (`dp`, `--dp N`, engine/dp_step.py): each rank runs only the chunks of
the requests whose pages are in its pool, with its own Batch; a rank with none runs the model's
`idle` forward, which joins the MoE layers' exchanges all the same. The final hidden states are
gathered rank by rank to every rank, and only the leader runs the LM head, for sampling and
scoring, on those rows; a follower runs no head at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pdserve.attention.backend import AttentionBackend, AttentionContext
from pdserve.attention.batch import Batch, BatchBuilder, Decodes, SeqSpan
from pdserve.attention.registry import default_backend, make_backend
from pdserve.engine import dp_step
from pdserve.engine.cuda_graphs import DecodeGraphs, GraphableBackend
from pdserve.engine.inflight import Feed
from pdserve.engine.prefill_graphs import PrefillGraphableBackend, PrefillGraphs
from pdserve.engine.prompt_scoring import (
    PROMPT_LOGPROB_ROWS,
    prompt_rows,
    row_logprobs,
    score_prompts,
)
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.pool import KVPool
from pdserve.model.llama import CausalLM
from pdserve.model.loader import LoadedModel
from pdserve.parallel.dp_tokens import DpTokens
from pdserve.parallel.lockstep import LockstepError
from pdserve.parallel.step_record import SeqPlan, StepRecord

log = logging.getLogger(__name__)


class Leader(Protocol):
    """Rank 0's side of a tensor-parallel group (engine/tp_leader.py TpLeader)."""

    def lead(self, seqs: Sequence[SeqPlan], score_rows: Sequence[int]) -> None:
        """Send the step's plan to every rank, once they all agreed on it."""

    def lost(self, error: Exception) -> LockstepError:
        """The group's end, naming the step and the rank at fault: `error` was raised after
        the step's record was sent."""


def _finished(owner: object) -> bool:
    """Whether a page-table row's owner has finished (its row is taken back if not released)."""
    return isinstance(owner, Request) and owner.status.finished


def graph_safe(model: LoadedModel) -> bool:
    """Whether a decode step of `model` may be captured in a CUDA graph: its forward never
    waits on the host (a model says so with `graph_safe()`; one that does not, cannot)."""
    says = getattr(model, "graph_safe", None)
    return bool(says is not None and says())


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        pool: KVPool,
        backend: str | None = None,
        *,
        cuda_graph_max_bs: int = 0,
        cuda_graph_max_tokens: int = 0,
        max_model_len: int | None = None,
        leader: Leader | None = None,
        dp: DpTokens | None = None,
    ) -> None:
        """`backend`: an attention backend's name (None: the device's default).
        `cuda_graph_max_bs`: capture decode graphs up to this batch (0: run eagerly; CUDA and a
        graph-capable backend only); `cuda_graph_max_tokens`: capture prefill graphs for steps
        of up to this many tokens that carry prefill chunks (0: none; only with decode
        graphs); `max_model_len` bounds their page tables. `leader`: this is rank 0 of a
        tensor-parallel group, whose steps it leads (no CUDA graphs then). `dp`: the group
        runs attention data-parallel (`--dp`), this rank's requests only."""
        self.model = model
        self.leader = leader
        self.dp = dp
        # A data-parallel rank's forward when it has no tokens (the model's `idle`).
        self._idle: Callable[[], torch.Tensor] = lambda: torch.empty(0)
        if dp is not None:
            enable, idle = getattr(model, "data_parallel", None), getattr(model, "idle", None)
            if enable is None or idle is None:
                raise ValueError(
                    f"{model.arch.family} has no data-parallel attention (--dp): it is built "
                    "for DeepSeek-V3 and V3.2, whose experts are sharded over the ranks"
                )
            enable(dp)
            self._idle = idle
        self.pool = pool
        self.device = pool.device
        name = backend or default_backend(self.device)
        if model.arch.v4 is not None and name != "torch":
            # The only one with V4's step_kv; V3's and V3.2's latent attention run on either
            # (triton: their decodes absorbed, V3.2's over its indexer's picks).
            log.info("%s's attention runs on the torch backend, not %s", model.arch.family, name)
            name = "torch"
        self.backend: AttentionBackend[Any] = make_backend(name, pool, model.arch)
        self.builder = BatchBuilder(pool.page_size, pool.num_pages, self.device, _finished)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if cuda_graph_max_bs > 0 and self.device.type == "cuda":
            if not isinstance(self.backend, GraphableBackend) or not graph_safe(model):
                log.info(
                    "%s on attention backend %s cannot be captured: steps run eagerly",
                    model.arch.family,
                    self.backend.name,
                )
                return
            max_len = max_model_len or pool.capacity_tokens
            max_pages = -(-min(max_len, pool.capacity_tokens) // pool.page_size)
            self.graphs = DecodeGraphs(model, self.backend, max_pages, cuda_graph_max_bs)
            self.graphs.capture()
            if (
                cuda_graph_max_tokens > 0
                and isinstance(self.backend, PrefillGraphableBackend)
                and isinstance(model, CausalLM)  # (a DeepSeek step with prompts runs eagerly)
            ):
                self.prefill_graphs = PrefillGraphs(
                    model, self.backend, max_pages, cuda_graph_max_tokens, self.graphs.sizes[-1]
                )
                self.prefill_graphs.capture()

    def build(self, chunks: Sequence[Chunk], feed: Feed | None = None) -> Batch:
        """The step's Batch; chunks in the scheduler's order (decodes first). A chunk whose
        last token is still in flight (`Request.pending`) takes it from `feed` on the device.

        Decodes go to the builder as columns (a few list comprehensions over the batch), each
        request keeping its page-table row from step to step (attention/page_table.py)."""
        nd = 0
        while nd < len(chunks) and chunks[nd].length == 1:
            nd += 1
        reqs = [c.request for c in chunks[:nd]]
        starts = [c.start for c in chunks[:nd]]
        ids = [r.token_at(p) for r, p in zip(reqs, starts, strict=True)]
        dst = [b for b, t in enumerate(ids) if t is None]  # rows of input_ids fed on the device
        src = self._feed_rows(feed, [reqs[b] for b in dst] if len(dst) < nd else reqs)
        decodes = Decodes(
            [0 if t is None else t for t in ids],  # a placeholder, overwritten below
            starts,
            [r.page_view for r in reqs],
            [c.samples for c in chunks[:nd]],
            list(reqs),
        )
        prefills: list[SeqSpan] = []
        at = nd
        for c in chunks[nd:]:
            req = c.request
            span_ids = req.tokens(c.start, c.start + c.length)
            if len(span_ids) < c.length:
                src.append(self._in_flight(feed, req, c.length - len(span_ids)))
                dst.append(at + c.length - 1)
                span_ids = [*span_ids, 0]
            prefills.append(SeqSpan(span_ids, c.start, req.page_view, c.samples, req))
            at += c.length
        slots = self._state_slots(chunks)
        resumes = [c.request.resumes_state for c in chunks] if slots else []
        if feed is None or not dst:
            return self.builder.build_step(
                decodes, prefills, state_slots=slots, state_resumes=resumes
            )
        extra = feed.staged_rows(dst, src)
        batch = self.builder.build_step(decodes, prefills, extra, slots, resumes)
        feed.fill(batch.input_ids, dst, src, batch.extra)
        return batch

    def _state_slots(self, chunks: Sequence[Chunk]) -> list[int]:
        """Each chunk's request's state slot, for a pool that keeps per-request state."""
        if self.pool.state is None:
            return []
        slots = []
        for c in chunks:
            lease = c.request.lease
            if lease is None or lease.slot is None:
                raise RuntimeError(f"request {c.request.request_id} runs without a state slot")
            slots.append(lease.slot)
        return slots

    @staticmethod
    def _in_flight(feed: Feed | None, req: Request, missing: int) -> int:
        """`req`'s row in `feed`: its one input token not on the host was sampled there."""
        if missing != 1:
            raise RuntimeError(
                f"request {req.request_id}: {missing} input tokens are not on the host; a "
                "step in flight sampled one at most"
            )
        return ModelRunner._feed_rows(feed, [req])[0]

    @staticmethod
    def _feed_rows(feed: Feed | None, reqs: list[Request]) -> list[int]:
        """The rows in `feed` of `reqs`, decodes whose input token was sampled there."""
        if not reqs:
            return []
        if feed is None:
            raise RuntimeError(
                f"request {reqs[0].request_id}: its input token is not on the host and no "
                "step in flight sampled it"
            )
        return feed.rows(reqs)

    def release(self, req: Request) -> None:
        """`req` left the engine: its page-table row may be reused (attention/page_table.py)."""
        self.builder.release(req)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], feed: Feed | None = None) -> torch.Tensor:
        """Logits [N, vocab] (the model's dtype; the sampler widens what it must) for the
        chunks that sample, in chunk order; `feed`: the step in flight's sampled ids, for
        inputs still on the device.

        With per-request state (DeepSeek-V4), a chunk of no tokens (a request preempted with
        its last token in flight) takes no part: it computes and samples nothing, and holds no
        state slot. A forward that raises undoes its state writes (attention/v4_kv.py), so the
        chunks can run again, one at a time (engine/isolation.py)."""
        if self.pool.state is None:
            return self._forward(chunks, feed)
        chunks = [c for c in chunks if c.length]
        if not chunks:
            dtype = self.model.lm_head.weight.dtype
            return torch.empty(0, self.model.arch.vocab_size, dtype=dtype, device=self.device)
        try:
            logits = self._forward(chunks, feed)
        except BaseException:
            self.backend_undo()
            raise
        for c in chunks:  # their slots are rebuilt: the next steps go on from them
            c.request.resumes_state = False
        return logits

    def backend_undo(self) -> None:
        """Undo the state writes of the step that just failed (a backend that keeps none:
        nothing to undo)."""
        undo = getattr(self.backend, "undo_state", None)
        if undo is not None:
            undo()

    def _forward(self, chunks: Sequence[Chunk], feed: Feed | None) -> torch.Tensor:
        if self.dp is not None:
            return self._forward_dp(chunks)
        batch = self.build(chunks, feed)
        if self.leader is None:
            return self._run(chunks, batch)
        self.leader.lead(self._plan(chunks), prompt_rows(chunks, batch.host_query_start).rows)
        try:
            return self._run(chunks, batch)
        except Exception as e:  # noqa: BLE001 - every rank runs this step: none may rerun it
            raise self.leader.lost(e) from e

    def _run(self, chunks: Sequence[Chunk], batch: Batch) -> torch.Tensor:
        hidden = self._hidden(batch)
        self._score_prompts(chunks, batch.host_query_start, hidden)
        return self._logits(batch, hidden)

    def _score_prompts(
        self, chunks: Sequence[Chunk], bases: Sequence[int], hidden: torch.Tensor
    ) -> None:
        score_prompts(self.model, prompt_rows(chunks, bases), hidden)

    def _forward_dp(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """The leader's data-parallel step: rank 0's chunks here, every rank's rows gathered,
        then the LM head on the rows that sample and score."""
        assert self.dp is not None and self.leader is not None
        split = dp_step.split(chunks, self.dp.group.world_size)
        own = split.of(chunks, 0)
        batch = self.build(own) if own else None
        plan = dp_step.local_pages(self._plan(chunks), split.ranks, self.pool.num_pages)
        self.leader.lead(plan, [])
        try:
            hidden = self._dp_hidden(batch, split.counts)  # [every rank's tokens, hidden]
            self._score_prompts(chunks, split.bases, hidden)
            rows = dp_step.sample_rows(chunks, split.bases)
            if not rows:
                return hidden.new_empty(0, self.model.arch.vocab_size)
            idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
            return self.model.compute_logits(hidden.index_select(0, idx))
        except Exception as e:  # noqa: BLE001 - every rank runs this step: none may rerun it
            raise self.leader.lost(e) from e

    def _dp_hidden(self, batch: Batch | None, counts: Sequence[int]) -> torch.Tensor:
        """Every rank's final hidden states, rank by rank, from this rank's `batch` (None: it
        has no tokens this step and joins the exchanges idle)."""
        assert self.dp is not None
        self.dp.begin(counts)
        own = self._hidden(batch) if batch is not None else self._idle()
        return self.dp.gather(own)

    def _hidden(self, batch: Batch) -> torch.Tensor:
        """The step's hidden states [T, hidden]: a graph's, else an eager forward."""
        hidden = self._replay(batch)
        if hidden is None:
            ctx = AttentionContext(self.backend, self.backend.prepare(batch))
            hidden = self.model(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        return hidden

    def _logits(self, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of the rows that sample."""
        if batch.num_samples == 0:
            return hidden.new_empty(0, self.model.arch.vocab_size)  # the logits dtype
        if batch.num_samples == batch.num_tokens:  # every row samples: most decode steps
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[batch.sample_indices])

    def _plan(self, chunks: Sequence[Chunk]) -> list[SeqPlan]:
        """The step's sequences as plain spans (parallel/step_record.py), for the followers:
        each chunk's tokens, start, the pages its tokens need, and whether it samples."""
        ps = self.pool.page_size
        plan = []
        for c in chunks:
            end = c.start + c.length
            ids = c.request.tokens(c.start, end)
            if len(ids) != c.length:  # with overlapped scheduling, which TP > 1 runs without
                raise RuntimeError(
                    f"request {c.request.request_id}: {c.length - len(ids)} input tokens are "
                    "not on the host; a tensor-parallel step sends every input id"
                )
            plan.append(SeqPlan(ids, c.start, list(c.request.page_view[: -(-end // ps)]),
                                c.samples))  # fmt: skip
        return plan

    @torch.inference_mode()
    def follow(self, record: StepRecord) -> None:
        """A follower rank runs the leader's step (`record`): the Batch its spans make, the
        forward, the prompt rows' LM head and the sampling rows', the same collectives in the
        same order as the leader's `forward`; the results are the leader's to use."""
        if self.dp is not None:  # its own sequences, then the gather; the head is the leader's
            seqs = [s for s in record.seqs if s.rank == self.dp.group.rank]
            own = [SeqSpan(s.token_ids, s.start, s.pages, s.samples) for s in seqs]
            counts = dp_step.rank_counts(record.seqs, self.dp.group.world_size)
            self._dp_hidden(self.builder.build(own) if own else None, counts)
            return
        spans = [SeqSpan(s.token_ids, s.start, s.pages, s.samples) for s in record.seqs]
        batch = self.builder.build(spans)
        hidden = self._hidden(batch)
        rows = list(record.score_rows)
        for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            row_logprobs(self.model, hidden, rows[s : s + PROMPT_LOGPROB_ROWS])
        self._logits(batch, hidden)

    def _replay(self, batch: Batch) -> torch.Tensor | None:
        """Hidden states [T, hidden] of the step from a graph: a decode graph for a step of
        decodes only, else a prefill graph (its decodes and chunks in one forward). None
        unless a captured bucket holds the step."""
        graphs: DecodeGraphs | PrefillGraphs | None = self.prefill_graphs
        if batch.num_decodes == batch.num_seqs:
            graphs = self.graphs
        if graphs is None or not graphs.fits(batch):
            return None
        return graphs.run(batch)
