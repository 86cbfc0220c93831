"""Overlapped scheduling: the step in flight, whose outputs are processed one step later.

With overlap on (RunnerConfig.overlap_schedule; CUDA's default) the step (engine/stepper.py) is

    schedule N+1 -> build and launch N+1 -> wait for N's sampled ids -> process N's outputs

so the CPU schedules, builds and launches step N+1 while the device still runs step N, and
processes N's tokens (streaming, stop checks) while the device runs N+1 (docs/architecture.md
§Loop). One thread still owns every request; nothing here is shared with another thread.

What makes it exact:
- **Inputs stay on the device.** A request sampled by step N has that token *pending*
  (`Request.pending`, counted in `num_tokens`, not yet in `output_ids`). Step N+1's batch holds
  a placeholder for it, and `Feed.fill` copies the id from N's sampled ids on the device
  before the forward: no host round trip between the steps (one slice copy when the requests
  that sampled in N decode in N+1 in the same order, else indices uploaded with the batch).
- **Sampling reads only counts.** A row's draw depends on (seed, output position) and the
  min_tokens bans on how many tokens it has, both known with a token pending
  (`Request.num_output_tokens`). Penalties read the ids from the sampler's state on the device
  (engine/sampling/penalty_state.py), where each step adds its draws as it launches: a token
  in flight is already counted, and nothing waits for the step in flight.
- **A grammar reads the token in flight.** A constrained row's mask depends on every token
  before it (engine/sampling/grammars.py), so a step that samples such a row with a token in
  flight completes the step in flight first (Stepper._launch), after launching its forward:
  the host then waits for step N, but the device still runs N+1's forward meanwhile.
- **One token past a stop, never emitted.** A request that stops on a token of step N (EOS,
  a stop id) was already scheduled in N+1; that row's token is dropped when N+1 is processed,
  because the request has finished. Stops known in advance (max_tokens, the length limit) set
  `Request.pending_last`, and the scheduler gives such a request no further chunk.
- **Pages outlive the step that writes them.** A request that ends while a step computing it
  is in flight (a stop, an abort, a deadline) keeps its pages in that step's `retire` list
  until the step completed: device work on one stream is ordered, but a transfer or a peer
  writing into a reused page is not.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.sampler import Sampled
from pdserve.engine.scheduler import Chunk
from pdserve.kvcache.lease import Lease
from pdserve.runtime.gpu_wait import wait_event

Picks = list[tuple[Request, int, TokenLogprob | None]]


class Feed:
    """A launched step's sampled ids on the device, by request: the next step's inputs."""

    def __init__(self, ids: torch.Tensor, reqs: Sequence[Request]) -> None:
        self.ids = ids  # [N] int64
        self._reqs = reqs
        self._rows: dict[int, int] | None = None  # id(request) -> row, made when first asked

    def rows(self, reqs: Sequence[Request]) -> list[int]:
        """Each of `reqs`' row in `ids`; RuntimeError naming one with no token in flight.
        Most steps ask for the step in flight's own requests in its order: checked by
        identity in one pass, no lookup per request."""
        if len(reqs) == len(self._reqs) and all(map(operator.is_, reqs, self._reqs)):
            return list(range(len(reqs)))
        if self._rows is None:
            self._rows = {id(r): i for i, r in enumerate(self._reqs)}
        rows = list(map(self._rows.get, map(id, reqs)))
        if None in rows:
            req = reqs[rows.index(None)]
            raise RuntimeError(f"request {req.request_id}: no token of it is in flight")
        return rows  # type: ignore[return-value]  # no None left

    def staged_rows(self, dst: list[int], src: list[int]) -> list[list[int]]:
        """The index lists `fill` needs on the device, uploaded with the step's batch: none when
        `dst` and `src` are each one run of consecutive rows (the common step: the requests
        that sampled last step decode now, in the same order)."""
        return [] if _is_run(dst) and _is_run(src) else [dst, src]

    def fill(
        self,
        input_ids: torch.Tensor,
        dst: list[int],
        src: list[int],
        staged: Sequence[torch.Tensor],
    ) -> None:
        """input_ids[dst[i]] = ids[src[i]], on the device, queued behind the step in flight;
        `staged`: `staged_rows(dst, src)` on the device."""
        if not staged:
            n = len(dst)
            input_ids[dst[0] : dst[0] + n].copy_(self.ids[src[0] : src[0] + n])
            return
        rows, picks = staged[0].long(), staged[1].long()
        input_ids.index_copy_(0, rows, self.ids.index_select(0, picks).to(input_ids.dtype))


def _is_run(rows: list[int]) -> bool:
    return rows == list(range(rows[0], rows[0] + len(rows)))


@dataclass
class InFlight:
    """A launched step: its chunks, the requests whose draws are still on the device (none
    when the step samples nothing, or its tokens were processed at once: the row-by-row
    fallback), and the leases of requests that ended while it ran."""

    chunks: list[Chunk]
    sampling: list[Request] = field(default_factory=list)
    sampled: Sampled | None = None
    retire: list[Lease] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._computes = {id(c.request) for c in self.chunks}
        self._done: torch.cuda.Event | None = None

    def launched(self, device: torch.device) -> None:
        """Everything of the step is queued: mark its end on the device's stream."""
        if device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()

    def wait(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Until the step ran on the device (its pages may then be reused by anyone), doing
        `meanwhile` between polls (Role.while_waiting)."""
        if self._done is not None:
            wait_event(self._done, "a step's end", meanwhile=meanwhile)

    def computes(self, req: Request) -> bool:
        """Whether this step reads or writes `req`'s pages."""
        return id(req) in self._computes

    def feed(self) -> Feed | None:
        if self.sampled is None:
            return None
        return Feed(self.sampled.ids, self.sampling)

    def picks(self, meanwhile: Callable[[], None] | None = None) -> Picks:
        """The step's tokens, waiting for its device->host copy if it has not landed (doing
        `meanwhile` between polls: Role.while_waiting)."""
        if self.sampled is None:
            return []
        ids, lps = self.sampled.result(meanwhile)
        return list(zip(self.sampling, ids, lps, strict=True))
