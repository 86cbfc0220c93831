"""Lockstep: the leader's step records reach every rank, and every rank proves it read the same.

Each step, before the forward's first collective:

  1. the leader broadcasts a head (the record's length in words, its step number), then the
     record's words (parallel/step_record.py), from the device on NCCL, from memory on gloo;
  2. every rank digests the plan it will run: the leader its encoded words, a follower the
     re-encoding of what it decoded (so a codec bug diverges too), or nothing if it could not
     decode them;
  3. every rank all-gathers (decoded, digest) from all ranks and compares: any rank whose
     digest is not the leader's (or that could not decode) stops every rank at once, before
     a forward that would otherwise hang or compute garbage (LESSONS #12, #21).

So each step costs three small collectives, and every one is bounded by the group's timeout
(parallel/group.py): a rank that died or stalls turns into `LockstepError` on the others,
never into a hang. Whatever the failure, `LockstepError` names the step and, where known, the
rank; the group is not used again after it (a collective that failed half way leaves the
ranks at different points of the sequence).

Each rank keeps a flight recorder (parallel/flight_recorder.py): the last FLIGHT_DEPTH records
it sent or received (step, kind, digest, sequences, tokens, words, when), written to its log
when it fails, and with a flight directory to `rank-<r>.json` in it, so the logs and the dumps
of all ranks show where they parted. A failure that names no rank (a collective failed) may be
followed by one that does (the leader found the follower that died): that one replaces it, in
`failed` and in the dump.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from pdserve.parallel import flight_recorder
from pdserve.parallel.flight_recorder import FLIGHT_DEPTH, Flight
from pdserve.parallel.group import CollectiveError, RankGroup
from pdserve.parallel.step_record import (
    Kind,
    PoolPlan,
    RecordError,
    SeqPlan,
    StepRecord,
    decode,
    digest,
    encode,
)

log = logging.getLogger(__name__)

MAX_WORDS = 1 << 28  # a record's bound: 2 GiB of words, far past any step's

# A follower may change the record it read before digesting it (a fault point of the engine's:
# engine/tp_follower.py), to prove that a divergent plan is caught.
Tamper = Callable[[StepRecord], StepRecord]


# The store key the leader sets just before SETUP: a follower waits for it (RankGroup.wait_mark)
# as long as a start may take, not a collective's bound.
SETUP_MARK = "tp-setup"


def loaded_mark(rank: int) -> str:
    """What follower `rank` marks once its shard is loaded: the leader sends SETUP, a collective
    bounded by the collective timeout, only after every follower has (a slow load is not a hang)."""
    return f"tp-loaded-{rank}"


class LockstepError(RuntimeError):
    """The ranks are out of step, or one of them is gone: the message names the step and the
    rank(s) at fault where known (`step`, `ranks`). The group cannot be used again."""

    def __init__(self, message: str, step: int, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = tuple(ranks)


class Lockstep:
    """This rank's end of the step records: `send` (the leader, rank 0) or `receive` (a
    follower), each checked by the digest agreement before it returns."""

    def __init__(
        self,
        group: RankGroup,
        device: torch.device,
        tamper: Tamper | None = None,
        depth: int = FLIGHT_DEPTH,
        dump_dir: Path | None = None,
    ) -> None:
        """`device`: where the collectives' tensors live (the rank's CUDA device on NCCL, the
        CPU on gloo); `dump_dir`: the group's flight directory (None: the log only)."""
        if group.world_size < 2:
            raise ValueError("lockstep is for a group of 2 ranks or more")
        self.group = group
        self.rank = group.rank
        self.device = device
        self.tamper = tamper
        self.dump_dir = dump_dir
        self.step = 0  # the last step sent or received
        self.last_at = time.monotonic()  # when it was
        self.flights: deque[Flight] = deque(maxlen=depth)
        self.failed: LockstepError | None = None

    # -- the leader -------------------------------------------------------------------------
    def send(
        self,
        kind: Kind,
        seqs: Sequence[SeqPlan] = (),
        score_rows: Sequence[int] = (),
        pool: PoolPlan | None = None,
    ) -> StepRecord:
        """Broadcast the next record and agree on it (the leader only); LockstepError if a
        rank disagrees or a collective fails."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} follows: only rank 0 sends step records")
        self._check_usable()
        record = StepRecord(kind, self.step + 1, seqs, score_rows, pool)
        words = encode(record)
        self.step = record.step
        mine = digest(words)
        self._note(record, mine, len(words))
        self._collective(
            lambda: self.group.broadcast(self._tensor([len(words), record.step])), "its head"
        )
        try:  # the head is out: whatever fails now leaves the followers mid-record
            self._collective(lambda: self.group.broadcast(self._tensor(words)), "its words")
            error = self._agree(True, mine)
        except LockstepError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. no memory for the words: the group ends
            raise self.fail(f"step {record.step}: rank 0 could not finish it: {e}", [0]) from e
        if error is not None:
            raise error
        return record

    # -- a follower -------------------------------------------------------------------------
    def receive(self) -> StepRecord:
        """The leader's next record, once every rank agreed on it (a follower only)."""
        if self.rank == 0:
            raise RuntimeError("rank 0 leads: it sends step records, never receives them")
        self._check_usable()
        head = self._tensor([0, 0])
        self._collective(lambda: self.group.broadcast(head), "its head")
        length, step = (int(v) for v in head.tolist())
        expected, self.step = self.step + 1, step
        if not 0 < length <= MAX_WORDS:  # cannot follow the leader's words: leave the group
            raise self.fail(f"step {step}: rank {self.rank} got a head of {length} words")
        words = self._tensor(np.zeros(length, dtype=np.int64))
        self._collective(lambda: self.group.broadcast(words), "its words")
        try:
            if step != expected:
                raise RecordError(f"rank {self.rank} expected step {expected}")
            record = decode(words.cpu().numpy())
            if self.tamper is not None:
                record = self.tamper(record)
            if record.step != step:
                raise RecordError(f"its words say step {record.step}")
        except RecordError as e:
            log.error("rank %d could not read step %d: %s", self.rank, step, e)
            raise self._agree(False, 0) or self.fail(f"step {step}: {e}", [self.rank]) from e
        mine = digest(encode(record))
        self._note(record, mine, length)
        error = self._agree(True, mine)
        if error is not None:
            raise error
        return record

    # -- both -------------------------------------------------------------------------------
    def _agree(self, decoded: bool, mine: int) -> LockstepError | None:
        """All-gather (decoded, digest) of every rank: the error naming the ranks whose digest
        is not the leader's (or that decoded nothing), None if all agree."""
        pair = self._tensor([[int(decoded), mine]])  # [1, 2]
        got: list[int] = []

        def gather() -> None:
            got.extend(self.group.all_gather_last_dim(pair).flatten().tolist())  # [2 * world]

        self._collective(gather, "the digests")
        ok, digests = got[0::2], got[1::2]
        bad = [r for r in range(1, len(ok)) if not ok[r] or digests[r] != digests[0]]
        if not bad:
            return None
        told = ", ".join(
            f"rank {r} {f'digested {digests[r]:#010x}' if ok[r] else 'could not read it'}"
            for r in bad
        )
        return self.fail(
            f"step {self.step}: the plan digests differ: the leader (rank 0) sent "
            f"{digests[0]:#010x}, {told}",
            bad,
        )

    def _collective(self, call: Callable[[], object], what: str) -> None:
        """A collective of this step; a failed one (a peer gone, or past the timeout) is
        LockstepError naming the step."""
        try:
            call()
        except CollectiveError as e:
            raise self.fail(
                f"step {self.step}: rank {self.rank} could not exchange {what}: {e}"
            ) from e

    def fail(self, why: str, ranks: Sequence[int] = ()) -> LockstepError:
        """The error to raise, once this rank's flight recorder is in its log (and its dump);
        the first failure is kept (`failed`), unless it named no rank and this one does, and
        the group is not used again."""
        error = LockstepError(why, self.step, ranks)
        first = self.failed is None
        names_the_rank = self.failed is not None and not self.failed.ranks and bool(ranks)
        if not (first or names_the_rank):
            return error
        self.failed = error
        if first:
            log.error(
                "rank %d of %d out of lockstep: %s\nflight recorder (its last %d records):\n%s",
                self.rank,
                self.group.world_size,
                why,
                len(self.flights),
                "\n".join(f"  {f}" for f in self.flights) or "  (none)",
            )
        else:
            log.error("rank %d: the failure was: %s", self.rank, why)
        self._dump(error)
        return error

    def _dump(self, error: LockstepError) -> None:
        if self.dump_dir is None:
            return
        dump = flight_recorder.dump_of(
            self.rank, self.group.world_size, error.step, error.ranks, str(error), self.flights
        )
        try:
            path = flight_recorder.write(self.dump_dir, dump)
        except OSError as e:  # the log holds the same records: say so, and fail as we were
            log.error("rank %d could not write its flight recorder: %s", self.rank, e)
        else:
            log.error("rank %d: flight recorder written to %s", self.rank, path)

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise LockstepError(
                f"the group failed at step {self.failed.step} and is not used again: {self.failed}",
                self.failed.step,
                self.failed.ranks,
            )

    def _note(self, record: StepRecord, mine: int, words: int) -> None:
        self.last_at = time.monotonic()
        self.flights.append(
            Flight(
                record.step,
                record.kind.name,
                mine,
                len(record.seqs),
                record.num_tokens,
                words,
                self.last_at,
            )  # fmt: skip
        )

    def _tensor(self, data: object) -> torch.Tensor:
        if isinstance(data, np.ndarray):
            return torch.from_numpy(data).to(self.device)
        return torch.tensor(data, dtype=torch.int64, device=self.device)
