"""Rank 0 of a tensor-parallel engine (`--tp N`): it starts ranks 1..N-1 as processes, leads
every step they run, and notices when one is gone.

**Startup** (`build_leader`, from Engine.build): a free port on 127.0.0.1 for
torch.distributed's store; each follower started as `python -m pdserve.engine.tp_follower`
(engine/tp_follower.py) on it; the group joined (gloo on the CPU, NCCL on CUDA with rank r on
`cuda:r`) while watching that no follower exits first, within TP_JOIN_TIMEOUT_S. Then the
engine loads rank 0's shard and sizes its pool, and `setup` sends the SETUP record: every
rank's pool has the leader's page count (each holds its own KV heads of every page).

**Serving.** The runner calls `lead` with each forward's plan (engine/runner.py); the engine
loop calls `tick` every turn: a follower that exited is noticed there, and after
TP_KEEPALIVE_S without a record an IDLE one keeps the followers' wait for the next record
within the collective timeout (LESSONS #21). Any failure, a digest mismatch, a collective that
failed or timed out, a follower gone, this rank's forward raising once its record was sent, is
a `LockstepError` naming the step and the rank: the engine fails every request and its thread
dies for good (`ranks_lost`), which turns /health red with that message and stops the
worker.

**Stopping** (`close`): SHUTDOWN when the group is sound, a bounded wait for each follower,
then SIGKILL by its pid; after a failure, a short wait for its log's flight recorder and the
kill. With `--flight-dir` (the group's directory, `--flight-dir`/tp-<this pid>-<start>, made
at the start: `flight_dumps`), that wait begins only once each follower's dump is there (or
it exited, or DUMP_WAIT_S passed): a follower writes its dump and then exits, and a kill must
not cut the dump short. A follower also dies with this process (PR_SET_PDEATHSIG) and ignores
SIGINT and SIGTERM: the leader decides when it stops.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import torch

from pdserve.config import EngineConfig
from pdserve.engine.request import Request
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, map_shared
from pdserve.kvcache.rank_pages import REF_WORDS, RankPages, rank_layout, ref_of, ref_words
from pdserve.model.config import ModelArch
from pdserve.parallel import flight_recorder
from pdserve.parallel.group import CollectiveError, RankGroup
from pdserve.parallel.lockstep import SETUP_MARK, Lockstep, LockstepError, loaded_mark
from pdserve.parallel.step_record import Kind, PoolPlan, SeqPlan
from pdserve.runtime.supervisor import ThreadFatal
from pdserve.runtime.timing import (
    TP_COLLECTIVE_TIMEOUT_S,
    TP_EXIT_TIMEOUT_S,
    TP_JOIN_TIMEOUT_S,
    TP_KEEPALIVE_S,
)

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # every rank on this host; the store listens on the loopback only
FAILED_EXIT_S = 1.0  # after a failure a follower gets this long to log its flight recorder
DUMP_WAIT_S = 2.0  # ... and, first, this long to write its dump (with a flight directory)
DUMP_POLL_S = 0.05
JOIN_POLL_S = 0.1
BLAME_WAIT_S = 0.2  # after a failed collective, how long a follower that died may take to exit


T = TypeVar("T")


class TpStartFailed(RuntimeError):
    """The group could not be formed: the message names the rank and why."""


def build_leader(cfg: EngineConfig, build: Callable[[torch.device, TpLeader], T]) -> T:
    """Rank 0 of a `cfg.tp` > 1 engine (Engine.build): the model is checked for `cfg.tp`
    ranks before any starts, the followers are started and joined, then `build(device,
    leader)` builds rank 0 on its device; if it fails, the followers are stopped."""
    arch = ModelArch.from_dir(Path(cfg.model.path))
    arch.for_rank(cfg.tp, 0)  # refused before any rank starts
    if cfg.dp_attention and arch.moe is None:
        raise ValueError(
            f"{arch.family} has no data-parallel attention (--dp): it is built for the "
            "DeepSeek-V3 family, whose experts are split over the ranks (--ep)"
        )
    device = rank_device(torch.device(cfg.model.device), 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    tp = TpLeader.start(cfg, device)
    try:
        return build(device, tp)
    except BaseException:
        tp.close()
        raise


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: `cuda:r` on CUDA (the worker sees all its ranks' cards), else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Follower:
    """One follower rank's process, known by its pid."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.proc = proc

    @classmethod
    def start(cls, rank: int, argv: list[str]) -> Follower:
        env = {**os.environ, "PDSERVE_LOG_TAG": f"tp-rank-{rank}"}
        # Its output goes where ours goes: the worker's log, each line tagged with its rank.
        return cls(rank, subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> str | None:
        """Why it is gone ("rank 1 (pid 4321) exited with status 1"), None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        return f"rank {self.rank} (pid {self.pid}) {how}"

    def stop(self, wait_s: float) -> None:
        """Wait `wait_s` for it to end, then SIGKILL it by its pid and reap it."""
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "tensor-parallel rank %d (pid %d) did not stop: killing it", self.rank, self.pid
            )
            self.proc.kill()
            self.proc.wait(10.0)


class TpLeader:
    """The followers' processes and rank 0's end of the step records."""

    def __init__(self, group: RankGroup, lockstep: Lockstep, followers: list[Follower]) -> None:
        self.group = group
        self.lockstep = lockstep
        self.followers = followers
        self.keepalive_s = min(TP_KEEPALIVE_S, (group.timeout_s or TP_COLLECTIVE_TIMEOUT_S) / 4)
        self.closed = False

    @classmethod
    def start(cls, cfg: EngineConfig, device: torch.device) -> TpLeader:
        """Start ranks 1..tp-1 and join their group as rank 0 (`device`: rank 0's)."""
        world, port = cfg.tp, _free_port()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise TpStartFailed(
                f"--tp {world} puts rank r on cuda:r, and this process sees "
                f"{torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES; --device cuda, "
                "not cuda:N, which gives the worker one)"
            )
        # The ranks' own connections on the loopback only, whatever the environment said
        # (every rank is on this host; NCCL's default skips `lo` for an outside interface).
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = "lo"
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        argv = [sys.executable, "-m", "pdserve.engine.tp_follower", "--world", str(world),
                "--port", str(port), "--parent", str(os.getpid()), "--model", cfg.model.path,
                "--dtype", cfg.model.dtype, "--backend", backend,
                "--timeout", str(TP_COLLECTIVE_TIMEOUT_S), "--join-timeout", str(TP_JOIN_TIMEOUT_S),
                "--threads", str(torch.get_num_threads()), "--log-level", level]  # fmt: skip
        if cfg.runner.attention_backend is not None:
            argv += ["--attention-backend", cfg.runner.attention_backend]
        argv += ["--index-k-dtype", cfg.cache.index_k_dtype]
        argv += ["--dp-attention"] if cfg.dp_attention else []
        try:
            dumps = flight_dumps(cfg)
        except OSError as e:
            raise TpStartFailed(
                f"tensor parallelism {world}: cannot make this group's flight directory under "
                f"--flight-dir {cfg.flight_dir}: {e}"
            ) from e
        argv += ["--flight-dir", str(dumps)] if dumps is not None else []
        followers: list[Follower] = []
        try:
            for r in range(1, world):
                dev = rank_device(device, r)
                followers.append(Follower.start(r, [*argv, "--rank", str(r), "--device", str(dev)]))
            log.info(
                "tensor parallelism %d: started ranks %s on port %d (%s)",
                world,
                ", ".join(f"{f.rank} (pid {f.pid})" for f in followers),
                port,
                backend,
            )
            group = _join(world, port, backend, followers)
        except BaseException:
            for f in followers:
                f.stop(0.0)
            raise
        return cls(group, Lockstep(group, device, dump_dir=dumps), followers)

    @property
    def pids(self) -> list[int]:
        return [f.pid for f in self.followers]

    # -- the engine's verbs -----------------------------------------------------------------
    def setup(self, pool: PoolPlan) -> None:
        """Every follower builds its pool as the leader's sizing chose (SETUP, the first record).
        The followers wait for it on the store (SETUP_MARK) as long as a start may take: the
        leader's own load and sizing come first, longer than any collective may."""
        self._await_loaded()
        self.group.mark(SETUP_MARK)
        self._send(Kind.SETUP, pool=pool)

    def _await_loaded(self) -> None:
        """Until every follower has marked its shard loaded, within TP_JOIN_TIMEOUT_S, naming
        one that exits meanwhile: SETUP is a collective, bounded by the collective timeout, and
        a follower that loads more slowly than rank 0 is not a hung one."""
        deadline = time.monotonic() + TP_JOIN_TIMEOUT_S
        world = len(self.followers) + 1
        for f in self.followers:
            while True:
                why = f.exited()
                if why is not None:
                    raise TpStartFailed(f"tensor parallelism {world}: {why} loading its shard")
                try:
                    self.group.wait_mark(loaded_mark(f.rank), JOIN_POLL_S)
                    break
                except CollectiveError as e:
                    if time.monotonic() > deadline:
                        raise TpStartFailed(
                            f"tensor parallelism {world}: rank {f.rank} did not load its shard "
                            f"within {TP_JOIN_TIMEOUT_S:.0f}s"
                        ) from e

    def pages(self, whole: KVLayout, own: KVPool, dp: bool = False) -> RankPages:
        """Every rank's pool as the whole model's pages (`whole`): rank 0's `own`, then each
        follower's, mapped from the reference it gave in the all-gather that follows a SETUP
        with `shared` (over the group, bounded by its collective timeout; never a value that
        anything else on the host could read or set), which must name a pool of its own."""
        try:
            words = self.group.all_gather_last_dim(ref_words(own.shm)).view(-1, REF_WORDS)
        except CollectiveError as e:
            raise TpStartFailed(f"the ranks' KV pools were not exchanged: {e}") from e
        pools, refs = [own.data], [own.shm]
        for f in self.followers:
            try:
                ref = ref_of(words[f.rank].tolist())
                if ref.pid != f.pid:
                    raise ValueError(f"it names pid {ref.pid}'s pool, not its own ({f.pid})")
                layout = rank_layout(whole, self.group.world_size, f.rank)
                pools.append(map_shared(ref, layout, own.num_rows))
                refs.append(ref)
            except ValueError as e:  # PoolRefused is a ValueError
                raise TpStartFailed(f"rank {f.rank}'s KV pool cannot be mapped: {e}") from e
        return RankPages(whole, pools, refs, dp=dp)

    def lead(self, seqs: Sequence[SeqPlan], score_rows: Sequence[int]) -> None:
        """Send a forward's plan, once every rank agreed on it (engine/runner.py Leader)."""
        self._send(Kind.FORWARD, seqs, score_rows)

    def tick(self) -> None:
        """Every turn of the engine loop: a follower gone is noticed; an idle group hears an
        IDLE record every `keepalive_s`."""
        if time.monotonic() - self.lockstep.last_at >= self.keepalive_s:
            self._send(Kind.IDLE)
        else:
            self._check_followers()

    def lost(self, error: Exception) -> LockstepError:
        """`error` came from this rank's forward after its record was sent: the group's end,
        naming a follower that died, else rank 0 itself."""
        if isinstance(error, LockstepError):
            return error
        return self._blame(error) or self.lockstep.fail(
            f"step {self.lockstep.step}: rank 0's forward raised after its record was sent, so "
            f"the ranks are no longer in step: {type(error).__name__}: {error}",
            [0],
        )

    def ranks_lost(
        self,
        error: LockstepError,
        requests: Iterable[Request],
        fail: Callable[[Request, str], object],
    ) -> NoReturn:
        """The group failed: the followers are stopped, each of the engine's `requests` fails
        (`fail(req, why)`) saying why, and the engine thread dies for good (ThreadFatal:
        /health names the step and the rank, and the worker stops)."""
        why = f"tensor-parallel ranks out of lockstep: {error}"
        log.critical("%s; failing every request", why)
        for req in requests:
            fail(req, why)
        self.close()  # after: its wait for the followers' dumps delays no answer
        raise ThreadFatal(why) from error

    def _send(
        self,
        kind: Kind,
        seqs: Sequence[SeqPlan] = (),
        score_rows: Sequence[int] = (),
        pool: PoolPlan | None = None,
    ) -> None:
        self._check_followers()
        try:
            self.lockstep.send(kind, seqs, score_rows, pool)
        except LockstepError as e:
            blamed = None if e.ranks else self._blame(e)  # a digest mismatch names them
            if blamed is None:
                raise
            raise blamed from e

    def _blame(self, error: Exception) -> LockstepError | None:
        """The error naming a follower that died, if one did: a peer's sockets close as it
        dies, so a collective that failed is often how the leader hears of it first."""
        for f in self.followers:
            try:
                f.proc.wait(BLAME_WAIT_S)
            except subprocess.TimeoutExpired:
                continue
            why = f.exited()
            if why is not None:
                return self.lockstep.fail(f"step {self.lockstep.step}: {why} ({error})", [f.rank])
        return None

    def close(self, shutdown: bool = True) -> None:
        """Stop every follower, once: SHUTDOWN if the group is sound and `shutdown` (False:
        another thread may still be in a collective), then by its pid."""
        if self.closed:
            return
        self.closed = True
        sound = self.lockstep.failed is None and all(f.exited() is None for f in self.followers)
        sound = sound and shutdown
        if sound:
            try:
                self.lockstep.send(Kind.SHUTDOWN)
            except LockstepError:
                sound = False  # logged with the flight recorder; the followers are killed
        if self.lockstep.failed is not None:
            self._await_dumps()
        for f in self.followers:
            f.stop(TP_EXIT_TIMEOUT_S if sound else FAILED_EXIT_S)
        if sound or self.lockstep.device.type != "cuda":
            # Leave the group, so that this process may form another (tests, tools); not a
            # failed NCCL communicator, whose teardown may wait on peers that are gone.
            self.group.close()

    def _await_dumps(self) -> None:
        """After a failure, wait at most DUMP_WAIT_S until every follower has written its dump
        or exited (a follower that never noticed the failure writes none: the wait runs out)."""
        directory = self.lockstep.dump_dir
        if directory is None:
            return
        deadline = time.monotonic() + DUMP_WAIT_S
        waiting = list(self.followers)
        while waiting := [
            f
            for f in waiting
            if f.exited() is None and not flight_recorder.dump_path(directory, f.rank).exists()
        ]:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "tensor-parallel ranks %s wrote no flight recorder in %.1fs: stopping them",
                    ", ".join(str(f.rank) for f in waiting),
                    DUMP_WAIT_S,
                )
                return
            try:  # wakes as soon as it exits; else looks for its dump again
                waiting[0].proc.wait(min(left, DUMP_POLL_S))
            except subprocess.TimeoutExpired:
                pass

    def _check_followers(self) -> None:
        for f in self.followers:
            why = f.exited()
            if why is not None:
                raise self.lockstep.fail(f"step {self.lockstep.step}: {why}", [f.rank])


def flight_dumps(cfg: EngineConfig) -> Path | None:
    """This group's flight directory (`--flight-dir`/tp-<this pid>-<now>), made now and its
    own (OSError if it cannot be), None without --flight-dir: every rank writes its flight
    recorder there if the group fails (parallel/flight_recorder.py)."""
    if cfg.flight_dir is None:
        return None
    return flight_recorder.new_group_dir(Path(cfg.flight_dir), os.getpid(), time.time())


def _join(world: int, port: int, backend: str, followers: list[Follower]) -> RankGroup:
    """Rank 0 joins the group, on a thread of its own so that this one notices a follower
    that exits before joining (rather than waiting out TP_JOIN_TIMEOUT_S)."""
    joined: list[RankGroup] = []
    failed: list[BaseException] = []

    def join() -> None:
        try:
            joined.append(RankGroup.init(0, world, host=HOST, port=port, backend=backend,
                                         timeout_s=TP_COLLECTIVE_TIMEOUT_S,
                                         join_timeout_s=TP_JOIN_TIMEOUT_S))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(e)

    thread = threading.Thread(target=join, name="tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(JOIN_POLL_S)
        for f in followers:
            why = f.exited()
            if why is not None and thread.is_alive():
                raise TpStartFailed(f"tensor parallelism {world}: {why} before joining the group")
    if failed:
        raise TpStartFailed(
            f"tensor parallelism {world}: rank 0 could not join: {failed[0]}"
        ) from failed[0]
    return joined[0]


def _signal_name(number: int) -> str:
    """SIGKILL, or the number of a signal Python has no name for (a real-time one)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
