"""Every time bound of pdserve's processes in one place, with why it has its value: the engine,
the engine process, the PD protocol, transfers, HTTP serving, the router's processes, the
launcher. (The tools' own timeouts, chaos, bench, doctor and the demo, stay with them.)

The bounds depend on each other (a peer is declared dead well before a fence ends; a Pong's
engine stall is judged by P's own heartbeat bound), so they are read together here. Modules
import the names they use. The PD roles take theirs as one value, `PdTiming` (at the end; its
defaults are these constants), and time from the engine's `Clock`: the loop passes each verb
`now` (monotonic), and a role reads only the wall clock itself, from that clock, for what
crosses hosts (write deadlines, ping stamps). So the roles' tests advance a fake clock instead
of racing the real one (tests/worker/fake_clock.py); tests of the HTTP paths still shorten a
wait by patching a module's copy of its bound.
docs/architecture.md §Deadlines and §Clocks describe how they combine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Protocol

# -- the engine loop (engine/engine.py) -----------------------------------------------------------
# With no batch to run but transfers in flight or rooms waiting on a peer, the loop wakes this
# often to poll them (an inbox command wakes it at once). Spinning instead would take a core
# from the peer or the transfer's progress thread on a small machine.
ROLE_POLL_S = 0.0005
ENGINE_HEARTBEAT_S = 30.0  # the engine thread's heartbeat bound: a CPU step can take seconds
# A thread waiting for the GPU to reach an event (a step's end, a copy) gives up after this
# (runtime/gpu_wait.py): far past any step, so only a hung device trips it.
GPU_WAIT_TIMEOUT_S = 120.0
OVERDUE_GRACE_S = 1.0  # a request or room this far past its deadline is reported by /health
OVERDUE_EVERY_S = 0.25  # how often the overdue list is recomputed
# The control and data-plane threads' heartbeat bound: their ticks block 0.1 s at most (a poll,
# a queue wait), so a tick this late is a thread stuck in a call.
IO_HEARTBEAT_S = 5.0

# -- the engine in its own process (worker/host/client.py, process.py) ----------------------
ENGINE_START_TIMEOUT_S = 1800.0  # a large checkpoint's load and its CUDA graphs' capture
ENGINE_STATUS_EVERY_S = 0.1  # how fresh the worker's view of health and pending work is
# The engine process reports every ENGINE_STATUS_EVERY_S; this long without, it is wedged.
ENGINE_STATUS_STALE_S = 10.0
ENGINE_SETUP_TIMEOUT_S = 30.0  # the worker sends Setup right after starting the process
# A worker that reads nothing from its engine process this long is wedged: the send raises.
ENGINE_SEND_TIMEOUT_S = 30.0
# Stop -> Stopped: the engine process's threads get THREADS_STOP_S (5 s) of it.
ENGINE_STOP_TIMEOUT_S = 15.0
ENGINE_EXIT_TIMEOUT_S = 5.0  # Stopped -> the process gone
# The worker's bound on closing its engine process: the stop, the exit, and a second's slack.
ENGINE_CLOSE_TIMEOUT_S = ENGINE_STOP_TIMEOUT_S + ENGINE_EXIT_TIMEOUT_S + 1.0

# -- tensor-parallel ranks (parallel/group.py) ----------------------------------------------------
# Joining a rank's process group, and every collective in it, ends within this: on gloo a
# collective a peer never joins raises, on NCCL the watchdog ends the process (LESSONS #21).
# Twice the engine's heartbeat bound: far past a slow CPU step of a peer rank.
TP_COLLECTIVE_TIMEOUT_S = 2 * ENGINE_HEARTBEAT_S
# Follower ranks are processes that import torch and load their shard: they join the group
# within the engine's start bound, not a collective's.
TP_JOIN_TIMEOUT_S = ENGINE_START_TIMEOUT_S
# An idle leader sends an IDLE record this often at least (a quarter of the collective bound if
# that is shorter): a follower's wait for the next record never reaches the collective bound,
# and a follower that died is noticed within it (engine/tp_leader.py, LESSONS #21).
TP_KEEPALIVE_S = 1.0
TP_EXIT_TIMEOUT_S = 5.0  # SHUTDOWN -> a follower gone; then it is killed by its pid

# -- decode worker D, about its prefill workers (worker/decode/role.py) ---------------------
PING_EVERY_S = 1.0
PEER_TIMEOUT_S = 5.0  # no pong for this long while rooms are open: the P is dead
# A Pong whose P engine has been inside one tick longer than P's own heartbeat bound does not
# count: P is up, its engine is stuck.
PEER_ENGINE_STALL_S = ENGINE_HEARTBEAT_S
ABORT_ACK_TIMEOUT_S = 5.0  # an Abort unanswered this long: the room is fenced
FENCE_S = 10.0  # pages of a dead P's rooms stay quarantined at least this long...
FENCE_MARGIN_S = 2.0  # ...and until this long after the room's (wall-clock) write deadline
PREFILL_TIMEOUT_S = 60.0  # a prefill leg may not take longer than this
# Clocks across hosts must agree within FENCE_MARGIN_S (§Clocks); D warns at half of it, from
# the timestamps of its pings and P's pongs, at most once per peer this often.
CLOCK_SKEW_WARN_S = FENCE_MARGIN_S / 2
CLOCK_SKEW_WARN_EVERY_S = 60.0

# -- prefill worker P, about its decode workers (worker/prefill/peers.py) -------------------------
CLOSE_AFTER_S = 2.0  # a dropped peer's writer is closed this much later (UCX fails its queue)
PEER_SILENCE_S = 15.0  # a decode worker silent this long (it pings every second) is dead

# -- transfers (transfer/) -----------------------------------------------------------------------
TRANSFER_TIMEOUT_S = 30.0  # no single NIXL WRITE may stay in flight longer than this
COPIER_QUEUE_WAIT_S = 0.1  # the copier's tick blocks this long at most (its heartbeat stays fresh)
# A frame worker's item (hashing or copying one KV page, milliseconds) that has not finished
# after this is a worker stuck in a call: the chunk it belongs to fails (transfer/frame_workers.py)
# before the waiting thread's heartbeat (IO_HEARTBEAT_S) goes stale.
FRAME_WORK_WAIT_S = 2.0
MAX_SKEW_S = 30.0  # a control frame stamped further than this from our clock is stale
HOLD_S = 1.0  # a message held back by a `reorder` fault goes out after this at the latest
DROP_LOG_EVERY_S = 5.0  # a flood of bad frames logs one line per kind this often

# -- the decode worker's prefill peers and clocks (worker/decode/peers.py, clock_skew.py) ---------
PEER_IDLE_S = 60.0  # a prefill peer without rooms this long is forgotten and its socket closed
MAX_RTT_S = 1.0  # a ping round trip slower than this says too little about the clocks' skew
# An address that failed to prove it is a prefill worker of the cluster (no signed HelloAck
# before PEER_TIMEOUT_S) is refused this long: no /generate caller can make D knock on a host
# again and again.
UNPROVEN_BACKOFF_S = 10.0

# -- HTTP serving: every process (server/, frontend/, worker/server.py, router/) ---------------
BODY_TIMEOUT_S = 30.0  # a request body slower than this is refused (408)
REFUSE_LINGER_S = 1.0  # a connection refused past the limit is closed this long after its 503
RETRY_AFTER_S = 1  # the Retry-After a 429 or 503 answers with
ACCEPT_BACKOFF_S = 1.0  # after EMFILE the accept loop rests this long (asyncio's own delay)
STREAM_GRACE_S = 10.0  # past an engine's own deadline, how long a stream waits for its final word
REMOTE_GRACE_S = 5.0  # the router's wait past a request's timeout for D's final word
# A router's output channel (worker/http/channels.py, router/channel.py): the worker writes a blank
# line this often, so that a router that has read nothing for CHANNEL_SILENCE_S knows the
# stream is dead (a host gone without a reset sends nothing, and the router never writes).
CHANNEL_HEARTBEAT_S = 2.0
CHANNEL_SILENCE_S = 10.0
# The router's abort of a request it stopped listening to is one POST; if that request's
# outputs still arrive this long after, it aborts it again (the POST was lost, or overtook
# the /generate it aborts).
ORPHAN_ABORT_AFTER_S = 3.0
DRAIN_S = 10.0  # a graceful stop waits this long at most for running requests (--drain-timeout)
ABORT_GRACE_S = 1.0  # then ends them, and waits this long for their answers to go out
HANDLERS_STOP_S = 1.0  # aiohttp then cancels the handlers still running after this
THREADS_STOP_S = 5.0  # and the supervised threads get this long to stop
ROUTER_STOP_S = 5.0  # the router's bound on stopping its health loop and aiohttp
STOP_POLL_S = 0.05  # how often a draining server looks whether it is idle
INFO_CALL_S = 5.0  # the router's one /info call to a worker at startup
DISCOVERY_RETRY_S = 0.5  # ...retried this often (a worker may still be binding its port)
# A decode worker remembers an aborted request id this long and refuses a /generate naming it
# (worker/http/aborted_ids.py): far longer than a connection's accept can lag behind another's.
ABORTED_KEEP_S = 60.0

# -- the router's processes, `router --processes N` (router/pool.py) ---------------------------
POOL_RESTART_WINDOW_S = 60.0  # a child's restarts are counted within this window
# A child's start may take this long past the fleet's discovery: imports, the tokenizer.
POOL_START_GRACE_S = 30.0
# A child still running this long past its drain is killed: its health loop, aborts, aiohttp.
POOL_STOP_GRACE_S = 2 * ROUTER_STOP_S + 5.0
POOL_POLL_S = 0.2  # the parent's loop: its children's output, signals, exits

# -- the launcher and logs (runtime/) ---------------------------------------------------------
LAUNCH_POLL_S = 0.05  # the startup barrier's look at the children's logs
LAUNCH_WAKE_S = 1.0  # the launcher's run loop's bound on a missed wake-up
LOG_REPEAT_WINDOW_S = 10.0  # a repeated log line is cut after 20 per this window

# -- the prefix cache's host tier (kvcache/host_loads.py) ------------------------------------------
# A load of cached pages from host memory into the device pool must end this long after it was
# issued, else its request computes those tokens instead (its pages stay out of use until the
# copy ends). A healthy load takes milliseconds (a prompt's pages over PCIe at ~25 GB/s: 1 GB
# in 40 ms); a copy still running after seconds is a stuck copy engine, and recomputing a
# prompt on a GPU takes well under this.
HOST_LOAD_TIMEOUT_S = 5.0

# The bounds (seconds) of every latency histogram, the engine's (TTFT, ITL, end to end) and the
# router's alike, so the two sides of one request bin alike: 1 ms to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# -- the PD roles' bounds as one value, and the clock they read ------------------------------


@dataclass(frozen=True)
class PdTiming:
    """The time bounds a prefill or decode role is built with (worker/prefill/role.py,
    worker/decode/role.py); the defaults are this module's constants, whose comments say why."""

    # D about its prefill workers
    ping_every_s: float = PING_EVERY_S
    peer_timeout_s: float = PEER_TIMEOUT_S
    peer_engine_stall_s: float = PEER_ENGINE_STALL_S
    abort_ack_timeout_s: float = ABORT_ACK_TIMEOUT_S
    fence_s: float = FENCE_S
    fence_margin_s: float = FENCE_MARGIN_S
    prefill_timeout_s: float = PREFILL_TIMEOUT_S
    peer_idle_s: float = PEER_IDLE_S
    unproven_backoff_s: float = UNPROVEN_BACKOFF_S
    max_rtt_s: float = MAX_RTT_S
    clock_skew_warn_s: float = CLOCK_SKEW_WARN_S
    clock_skew_warn_every_s: float = CLOCK_SKEW_WARN_EVERY_S
    # P about its decode workers
    peer_silence_s: float = PEER_SILENCE_S
    close_after_s: float = CLOSE_AFTER_S

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"PdTiming.{f.name} must be a finite number > 0, got {value!r}")


PD_TIMING = PdTiming()  # the constants above, as a role's default


class Clock(Protocol):
    """Where time comes from: `monotonic()` for local deadlines, `wall()` (unix seconds) for
    what crosses hosts (a room's write deadline, a Ping's and a Pong's stamps)."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The process's clocks: `time.monotonic` and `time.time`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


SYSTEM_CLOCK: Clock = SystemClock()
