"""A prefill role and a decode role in one process, with no sockets between them.

Each engine's transport hands the messages its role returns to the other engine's inbox, as
`Inbound`s, the way the control plane would (the prefill side answers Pings on the calling
thread first, as `Engine.on_control` does on the control thread). KV moves over the real shm
data plane: the decode engine's pool is shared memory that the prefill role maps. Links can be
cut in either direction to play a lost peer.

Both engines read time from one fake clock (`wire.clock`, tests/worker/fake_clock.py): it
stands still while the engines tick, so no deadline passes, no ping falls due and no peer goes
silent unless the test advances it. (Pages are copied inside `write()`, with no copier, so the
transfer layer's own deadline checks, on the real clock, never run here.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pdserve.engine.engine import Engine
from pdserve.engine.offline import build_engine
from pdserve.protocol.messages import Send
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.control import Inbound
from pdserve.worker.decode.role import DecodeRole
from pdserve.worker.prefill.role import PrefillRole
from tests.worker.fake_clock import FakeClock

P_ADDR = "tcp://prefill.test:1"  # what D calls P (never dialled)
P_ID, D_ID = "prefill-test", "decode-test"
MAX_TICKS = 2_000  # a run_until that needs more is stuck (the longest test needs about 60)


class Wire:
    def __init__(
        self,
        model_dir: Path,
        *,
        page_size: int = 4,
        chunk: int = 16,
        overlap: bool | None = None,
        index_k: tuple[str, str] = ("auto", "auto"),  # V3.2's index-K mode on P, on D
        kv_dtype: tuple[str, str] = ("auto", "auto"),  # V4's KV dtype on P, on D
        dtype: str = "float32",
        d_kv_mb: float = 4.0,  # D's pool (a small one: memory pressure, preemption on D)
        p_kv_mb: float = 4.0,  # P's pool
        p_wall_ahead_s: float = 0.0,  # P's wall clock this far ahead of D's (another host's)
    ) -> None:
        def engine(shared: bool) -> Engine:
            return build_engine(
                model_dir,
                page_size=page_size,
                max_batched_tokens=chunk,
                kv_budget_mb=d_kv_mb if shared else p_kv_mb,
                max_model_len=1024,
                shared_pool=shared,
                overlap_schedule=overlap,
                index_k_dtype=index_k[1 if shared else 0],  # D has the shared pool
                kv_dtype=kv_dtype[1 if shared else 0],
                dtype=dtype,
            )

        self.p, self.d = engine(False), engine(True)
        self.clock = FakeClock()
        self.p.clock, self.d.clock = self.clock.ahead(p_wall_ahead_s), self.clock
        # Each role's metrics go into its engine's registry, as in a worker (local_engine.py).
        self.p_role = PrefillRole(self.p, P_ID, address=P_ADDR, registry=self.p.metrics.registry)
        self.forgotten: list[str] = []  # prefill addresses whose transport D closed
        self.d_role = DecodeRole(
            self.d, D_ID, "shm", forget=self.forgotten.append, registry=self.d.metrics.registry
        )
        self.p.attach(self.p_role, self._from_p)
        self.d.attach(self.d_role, self._from_d)
        self.to_p = self.to_d = True  # links up
        self.sent: list[tuple[str, str]] = []  # (direction, message type), delivered or not

    def _from_d(self, out: Send) -> None:
        if out.peer != P_ADDR:  # a prefill worker nobody runs: the message goes nowhere
            self.sent.append((f"d>{out.peer}", type(out.msg).__name__))
            return
        self.sent.append(("d>p", type(out.msg).__name__))
        if self.to_p:
            inbound = Inbound(out.msg.sender, out.msg)
            self.p.on_control(inbound)
            self.p.inbox.put(inbound)

    def _from_p(self, out: Send) -> None:
        assert out.peer == D_ID, out.peer
        self.sent.append(("p>d", type(out.msg).__name__))
        if self.to_d:
            self.d.inbox.put(Inbound(P_ADDR, out.msg))

    def submit(
        self, rid: str, prompt: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> list[RequestOutput]:
        """Submit to D with P as its prefill worker; returns the list its outputs land in."""
        outs: list[RequestOutput] = []
        self.d.submit(rid, prompt, params, outs.append, timeout_s, prefill=P_ADDR)
        return outs

    def run_jobs(
        self, jobs: list[tuple[list[int], SamplingParams]]
    ) -> dict[str, tuple[list[int], str | None]]:
        """Submit each (prompt, params) as r0, r1, ...; run until every one ended and both
        sides are idle; each one's tokens and finish reason, as engine/offline.py `run` gives."""
        outs = {f"r{i}": self.submit(f"r{i}", p, sp) for i, (p, sp) in enumerate(jobs)}
        self.run_until(lambda: all(o and o[-1].finish_reason for o in outs.values()))
        self.run_until(self.idle)
        return {
            rid: ([t for o in got for t in o.token_ids], got[-1].finish_reason)
            for rid, got in outs.items()
        }

    def tick(self, p: bool = True, d: bool = True) -> None:
        if d:
            self.d.tick()
        if p:
            self.p.tick()

    def run_until(
        self, done: Callable[[], bool], max_ticks: int = MAX_TICKS, p: bool = True, d: bool = True
    ) -> None:
        """Tick (D, then P) until `done()`; the clock stands still meanwhile."""
        for _ in range(max_ticks):
            if done():
                return
            self.tick(p, d)
        if not done():
            raise AssertionError(f"not done after {max_ticks} ticks; messages: {self.sent}")

    def idle(self) -> bool:
        """No room open on either side and no page held: nothing leaked."""
        return (
            not self.d_role.by_room
            and not self.d_role.admitting
            and not self.p_role.by_room
            and self.d.pool.allocator.num_held == 0
            and self.p.pool.allocator.num_held == 0
        )

    def violations(self) -> list[str]:
        return self.d.leases.violations() + self.p.leases.violations()


def ended(outs: list[RequestOutput]) -> bool:
    return bool(outs) and outs[-1].finish_reason is not None


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]
