"""Every time bound of pdserve's processes in one place, with why it has its value: the engine,
the PD protocol, transfers, HTTP serving, the launcher. (The tools' own timeouts, chaos, bench,
doctor and the demo, stay with them.)

The bounds depend on each other (a peer is declared dead well before a fence ends; a Pong's
engine stall is judged by P's own heartbeat bound), so they are read together here. Modules
import the names they use; tests may monkeypatch a module's copy to shorten a wait.
docs/architecture.md §Deadlines and §Clocks describe how they combine.
"""

from __future__ import annotations

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
MAX_SKEW_S = 30.0  # a control frame stamped further than this from our clock is stale
HOLD_S = 1.0  # a message held back by a `reorder` fault goes out after this at the latest
DROP_LOG_EVERY_S = 5.0  # a flood of bad frames logs one line per kind this often

# -- the decode worker's prefill peers and clocks (worker/decode/peers.py, clock_skew.py) ---------
PEER_IDLE_S = 60.0  # a prefill peer without rooms this long is forgotten and its socket closed
MAX_RTT_S = 1.0  # a ping round trip slower than this says too little about the clocks' skew

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
