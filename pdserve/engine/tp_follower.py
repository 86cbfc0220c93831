"""A follower rank of a tensor-parallel engine: a process with its shard and its pool that runs
what the leader's step records say, and decides nothing.

Started by the leader (engine/tp_leader.py) as `python -m pdserve.engine.tp_follower ...`. It
joins the group, loads its shard of the model, builds its KV pool from the SETUP record (the
leader's page count: each rank holds its own KV heads of every page), then loops: receive a
record, run it (a FORWARD through `ModelRunner.follow`: the Batch the record's spans make, the
same collectives as the leader's forward), until SHUTDOWN. It has no scheduler, no request, no
clock of its own to act on: everything it does is in a record all ranks agreed on
(parallel/lockstep.py, LESSONS #12).

Any failure, a digest mismatch, a collective that failed or timed out (the leader is gone or
stalled), its own forward raising, is written to its log with its flight recorder (and, given
`--flight-dir`, the group's directory, to a dump there: parallel/flight_recorder.py) and ends the
process with status 1 at once (os._exit: no teardown of a group a peer left half way); the
leader hears of it through its next collective or `TpLeader.tick`. It dies with the leader's
process (PR_SET_PDEATHSIG: SIGKILL) and ignores SIGINT and SIGTERM, which a terminal sends to
the whole process group: the leader decides when it stops.

Fault point `tp.recv.<rank>` (runtime/faults.py), hit on each FORWARD record: `malformed`
changes the record's first token before it is digested, so this rank's plan is not the
leader's (a desynchronised rank); `exit` ends the rank mid-generation.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from pdserve.config import INDEX_K_DTYPES
from pdserve.engine.runner import ModelRunner
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.kvcache.rank_pages import ref_words
from pdserve.model.loader import load_model
from pdserve.parallel.dp_tokens import DpTokens
from pdserve.parallel.group import BACKENDS, RankGroup
from pdserve.parallel.lockstep import SETUP_MARK, Lockstep, LockstepError, Tamper, loaded_mark
from pdserve.parallel.step_record import Kind, StepRecord
from pdserve.runtime import logs
from pdserve.runtime.child import die_with_parent
from pdserve.runtime.faults import FAULTS, Verdict

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


def tamper(rank: int) -> Tamper:
    """The fault point `tp.recv.<rank>` on each FORWARD record this rank reads."""
    point = f"tp.recv.{rank}"

    def hit(record: StepRecord) -> StepRecord:
        if record.kind is not Kind.FORWARD or not FAULTS.enabled or not record.seqs:
            return record
        if FAULTS.hit(point) is not Verdict.MALFORMED:
            return record
        first = record.seqs[0]
        changed = dataclasses.replace(
            first, token_ids=[first.token_ids[0] ^ 1, *first.token_ids[1:]]
        )
        return dataclasses.replace(record, seqs=[changed, *record.seqs[1:]])

    return hit


def build_runner(args: argparse.Namespace, group: RankGroup, lockstep: Lockstep) -> ModelRunner:
    """This rank's shard, and its pool as the leader's SETUP record says."""
    device = torch.device(args.device)
    model = load_model(Path(args.model), getattr(torch, args.dtype), device, group)
    FAULTS.hit("tp.follower.loaded")
    group.mark(loaded_mark(group.rank))  # the leader's SETUP waits for every rank's
    group.wait_mark(SETUP_MARK, args.join_timeout)  # the leader loads and sizes first
    setup = lockstep.receive()
    if setup.pool is None:
        raise lockstep.fail(f"step {setup.step}: a {setup.kind.name} record before SETUP", [0])
    layout = KVLayout.for_model(
        model.arch, args.dtype, setup.pool.page_size, args.index_k_dtype,
        tp_rank=group.rank, tp_size=group.world_size,
    )  # fmt: skip
    if layout.page_size != setup.pool.page_size:
        raise lockstep.fail(
            f"step {setup.step}: rank {group.rank}'s pages hold {layout.page_size} tokens, "
            f"the leader's {setup.pool.page_size}",
            [group.rank],
        )
    pool = KVPool(layout, setup.pool.num_pages, device, shared=setup.pool.shared)
    if setup.pool.shared:  # the leader maps it (kvcache/rank_pages.py): one all-gather
        group.all_gather_last_dim(ref_words(pool.shm))
    what = (
        f"{layout.num_kv_heads} KV heads"
        if {b.name for b in layout.buffers} == {"k", "v"}
        else f"its experts' share, whole {', '.join(b.name for b in layout.buffers)}"
    )
    log.info(
        "tensor-parallel rank %d of %d: %s, %d pages of %d tokens on %s",
        group.rank,
        group.world_size,
        what,
        pool.num_pages,
        pool.page_size,
        device,
    )
    dp = DpTokens(group) if args.dp_attention else None  # its own requests' attention only
    return ModelRunner(model, pool, args.attention_backend, dp=dp)


def follow(runner: ModelRunner, lockstep: Lockstep) -> None:
    """Run the leader's records until SHUTDOWN."""
    while True:
        record = lockstep.receive()
        match record.kind:
            case Kind.FORWARD:
                runner.follow(record)
            case Kind.IDLE:
                pass
            case Kind.SHUTDOWN:
                return
            case _:
                raise lockstep.fail(f"step {record.step}: a {record.kind.name} record mid-run", [0])


def run(args: argparse.Namespace) -> int:
    """The rank's life: join, build, follow; the exit status."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    try:
        group = RankGroup.init(args.rank, args.world, host=HOST, port=args.port,
                               backend=args.backend, timeout_s=args.timeout,
                               join_timeout_s=args.join_timeout)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the leader sees this rank exit before joining
        log.error("tensor-parallel rank %d could not join the group: %s", args.rank, e)
        return 1
    dumps = Path(args.flight_dir) if args.flight_dir else None
    lockstep = Lockstep(group, device, tamper(args.rank), dump_dir=dumps)
    try:
        follow(build_runner(args, group, lockstep), lockstep)
    except LockstepError:
        return 1  # its flight recorder is in the log (Lockstep.fail)
    except Exception as e:  # noqa: BLE001 - its own build or forward: the group is over
        log.exception("tensor-parallel rank %d failed", args.rank)
        lockstep.fail(f"step {lockstep.step}: rank {args.rank} raised {type(e).__name__}: {e}")
        return 1
    group.close()
    log.info("tensor-parallel rank %d stopped", args.rank)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve.engine.tp_follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--attention-backend", default=None)
    p.add_argument(
        "--index-k-dtype",
        default="auto",
        choices=INDEX_K_DTYPES,
        help="V3.2's index-K, as the leader's",
    )
    p.add_argument(
        "--dp-attention",
        action="store_true",
        help="each rank attends the requests the plan gives it (engine/dp_step.py)",
    )
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--join-timeout", type=float, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--flight-dir", default=None, help="the group's flight directory")
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.setup(args.log_level)
    torch.set_num_threads(max(1, args.threads))
    code = run(args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a failed group's threads and sockets are not torn down, only left


if __name__ == "__main__":
    main()
