"""The engine of a worker with its role: built, its threads started, watched and closed.

`LocalEngine` is what runs the requests of one worker: the `Engine` and, for a prefill or
decode worker, its role (worker/prefill/role.py, worker/decode/role.py), the ZMQ control
socket and the data-plane copier. It runs either inside the worker process, beside the event
loop, or alone in the engine process (`serve --engine-process`, worker/host/process.py); the
worker's server (worker/server.py) reaches it directly or through `EngineClient`
(worker/host/client.py), which offer it the same `EngineHost` surface.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.config import ServerConfig
from pdserve.engine.engine import Engine
from pdserve.protocol.messages import Msg, Send
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.faults import FAULTS
from pdserve.runtime.supervisor import Supervisor
from pdserve.runtime.timing import ENGINE_HEARTBEAT_S, IO_HEARTBEAT_S
from pdserve.transfer.control import Control, Inbound
from pdserve.transfer.control_limits import prefill_inbound_bytes
from pdserve.transfer.copier import Copier
from pdserve.transfer.frame_workers import FrameWorkers, default_workers
from pdserve.transfer.receiver import needs_shared_pool
from pdserve.transfer.stager import Stager
from pdserve.worker.decode.role import DecodeRole
from pdserve.worker.pd_role import SendFailed
from pdserve.worker.prefill.role import PrefillRole

log = logging.getLogger(__name__)


class EngineHost(Protocol):
    """What the worker's server needs of its engine, wherever it runs."""

    info: dict[str, Any]  # what /info adds: the KV layout, the role's identity and address

    @property
    def hard_exit(self) -> bool:
        """The process must leave with os._exit (worker/server.py says why)."""

    @property
    def frontend(self) -> Any:
        """validate/submit/abort, cfg, max_model_len, vocab_size: the APIs' backend."""

    def problems(self) -> list[str]: ...

    def has_work(self) -> bool: ...

    async def state(self) -> tuple[dict[str, Any], list[dict[str, object]]]:
        """The engine's snapshot (TimeoutError if it does not answer) and the threads of the
        engine's process, if it has its own."""

    async def metrics_text(self) -> bytes: ...

    async def faults(self, spec: str | None = None, seed: int = 0) -> dict[str, object]:
        """The fault points; with `spec`, set first (ValueError: a bad spec, nothing set)."""

    async def close(self, stuck: list[str] | None) -> list[str] | None:
        """After the worker's own threads stopped (`stuck`: those that did not, None if
        unknown): the engine's threads stopped too and its pool closed; all that did not stop."""


def require_key(cfg: ServerConfig) -> ClusterKey | None:
    """The cluster key; a prefill or decode worker without one cannot serve (ValueError)."""
    key = ClusterKey.from_env(cfg.cluster_key_file)
    if key is None and cfg.role != "colocated":
        raise ValueError(
            f"a {cfg.role} worker needs the cluster key: --cluster-key-file FILE or "
            "$PDSERVE_CLUSTER_KEY_FILE (`pdserve keygen --out FILE` makes one; "
            "`pdserve launch` makes one per cluster)"
        )
    return key


class LocalEngine:
    """The engine and its role in this process; `start` runs their threads under a supervisor."""

    def __init__(self, cfg: ServerConfig, eos_token_ids: frozenset[int]) -> None:
        key = require_key(cfg)
        self.cfg = cfg
        self.control: Control | None = None
        self.copier: Copier | None = None
        self.stager: Stager | None = None  # D on tcp
        self.workers: FrameWorkers | None = None  # the tcp data plane's, P or D
        self.info: dict[str, Any] = {"pid": os.getpid()}
        self.engine: Engine
        if cfg.role == "colocated":
            self.engine = Engine.build(cfg.engine, eos_token_ids)
        else:
            identity = f"{cfg.role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            assert key is not None  # require_key refuses a worker without one
            self.control = Control(identity, self._to_engine, self._send_failed, key)
            if cfg.role == "prefill":
                self.engine = Engine.build(cfg.engine, eos_token_ids, pd=True)
                limit = prefill_inbound_bytes(self.engine.model.arch.max_position_embeddings)
                self.info["control"] = self.control.bind(cfg.host, cfg.control_port, limit)
                self.workers = FrameWorkers(default_workers())
                self.copier = Copier(self.workers)
                role = PrefillRole(
                    self.engine,
                    identity,
                    self.control,
                    self.copier,
                    registry=self.engine.metrics.registry,  # the role adds its own metrics
                )
                self.engine.attach(role, self._send)
            else:
                shared = needs_shared_pool(cfg.backend)
                self.engine = Engine.build(cfg.engine, eos_token_ids, shared_pool=shared, pd=True)
                limit = prefill_inbound_bytes(self.engine.model.arch.max_position_embeddings)
                self.control.limit_sends(limit)  # P's limit for the same model
                d_role = DecodeRole(
                    self.engine,
                    identity,
                    cfg.backend,
                    self.control,
                    self.control.forget,
                    registry=self.engine.metrics.registry,  # the role adds its own metrics
                )
                self.engine.attach(d_role, self._send)
                if d_role.receiver.stages_frames:  # KV frames checked off both threads
                    self.workers = FrameWorkers(default_workers())
                    pool = self.engine.pool.data
                    page_bytes = d_role.pages.page_bytes
                    self.stager = Stager(self._queue, page_bytes, pool.is_cuda, self.workers)
                    d_role.stager = self.stager
            self.info.update(identity=identity, backend=cfg.backend)
        # what a peer compares: the whole model's (rank 0's pool holds its heads only at TP > 1)
        pages = self.engine.pages
        self.info["layout"] = (pages.layout if pages else self.engine.pool.layout).to_dict()
        if self.engine.tp is not None:  # its follower ranks' processes, stopped with it
            self.info["tp"] = {
                "size": self.engine.cfg.tp,
                "pids": self.engine.tp.pids,
                "data_parallel_attention": self.engine.cfg.dp_attention,
            }
        sched = self.engine.cfg.scheduler  # as resolved (engine/sizing.py)
        self.info["limits"] = {
            "max_model_len": self.engine.max_model_len,
            "max_running": sched.max_running,
            "max_batched_tokens": sched.max_batched_tokens,
            "kv_pool_tokens": self.engine.pool.capacity_tokens,
        }

    @property
    def frontend(self) -> Engine:
        return self.engine

    @property
    def hard_exit(self) -> bool:
        return self.engine.role.hard_exit

    def _to_engine(self, inbound: Inbound) -> None:
        self.engine.on_control(inbound)  # on this (control) thread: see Engine.on_control
        if self.stager is not None:
            self.stager.put(inbound)  # in order, behind the KV chunks it stages
        else:
            self.engine.inbox.put(inbound)

    def _queue(self, cmd: object) -> None:
        self.engine.inbox.put(cmd)

    def _send(self, out: Send) -> None:
        assert self.control is not None  # only a prefill or decode role sends
        self.control.send(out.peer, out.msg)

    def _send_failed(self, peer: str, msg: Msg, why: str) -> None:
        self.engine.inbox.put(SendFailed(peer, msg, why))

    def start(self, supervisor: Supervisor, after_tick: Callable[[], None] | None = None) -> None:
        """The engine, control and data-plane threads; `after_tick` runs after each of the
        engine's ticks, on its thread (the engine process sends the tick's outputs there)."""
        tick = self.engine.tick
        if after_tick is not None:
            engine_tick = tick

            def tick() -> None:
                try:
                    engine_tick()
                finally:
                    after_tick()

        supervisor.spawn("engine", tick, heartbeat_timeout_s=ENGINE_HEARTBEAT_S)
        if self.control is not None:
            supervisor.spawn("control", self.control.tick, heartbeat_timeout_s=IO_HEARTBEAT_S)
        if self.copier is not None:
            supervisor.spawn("dataplane", self.copier.tick, heartbeat_timeout_s=IO_HEARTBEAT_S)
        if self.stager is not None:
            supervisor.spawn("stager", self.stager.tick, heartbeat_timeout_s=IO_HEARTBEAT_S)
        if self.workers is not None:
            for i in range(self.workers.workers):
                work = self.workers.tick
                supervisor.spawn(f"frames-{i}", work, heartbeat_timeout_s=IO_HEARTBEAT_S)

    def problems(self) -> list[str]:
        """The engine's own: a loop that stopped ticking, requests past their deadline."""
        out = []
        stale = self.engine.clock.monotonic() - self.engine.last_tick
        if stale > ENGINE_HEARTBEAT_S:
            out.append(f"engine loop has not ticked for {stale:.1f}s")
        overdue = self.engine.overdue
        if overdue:
            more = f" (and {len(overdue) - 1} more)" if len(overdue) > 1 else ""
            out.append(f"past its deadline and not ended: {overdue[0]}{more}")
        return out

    def has_work(self) -> bool:
        return self.engine.has_work()

    def metrics_bytes(self) -> bytes:
        return self.engine.metrics.render()

    def set_faults(self, spec: str | None, seed: int) -> dict[str, object]:
        """Configure the fault points from `spec` (None: leave them), then their state."""
        if spec is not None:
            FAULTS.configure(spec, seed)
        return FAULTS.snapshot()

    async def state(self) -> tuple[dict[str, Any], list[dict[str, object]]]:
        return await asyncio.to_thread(self.engine.snapshot, 2.0), []

    async def metrics_text(self) -> bytes:
        return self.metrics_bytes()

    async def faults(self, spec: str | None = None, seed: int = 0) -> dict[str, object]:
        return self.set_faults(spec, seed)

    async def close(self, stuck: list[str] | None) -> list[str] | None:
        """`close_now` (EngineHost's surface): the threads that did not stop in time."""
        self.close_now(stuck)
        return stuck

    def close_now(self, stuck: list[str] | None) -> None:
        """After the threads were stopped (`stuck`: those that did not stop in time, None if
        unknown): settle the role, close the control socket and the pool."""
        if stuck == []:  # the engine thread no longer touches the transfer agents
            self.engine.role.settle()
        if self.control is not None:
            self.control.close()
        if self.engine.tp is not None:  # SHUTDOWN only once the engine thread left the group
            self.engine.tp.close(shutdown=stuck == [])
        self.engine.pool.close()
