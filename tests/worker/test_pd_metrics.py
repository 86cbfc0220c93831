"""What the PD roles add to their engines' /metrics, with both roles in one process.

The roles run against each other over tests/worker/wire.py on one fake clock, and each
registers into its engine's registry as a worker does, so the values read here are what
that worker's /metrics would show, exactly: the times are the clock's steps.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.protocol import messages as m
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.control import Inbound
from tests.worker.wire import D_ID, Wire, ended

PROMPT = [(i * 7) % 200 + 3 for i in range(37)]  # crosses pages (4) and chunks (16)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_a_remote_prefill_counts_once_with_its_bytes_transfer_and_wait(tiny_dir):
    wire = Wire(tiny_dir)
    d, p = wire.d.metrics.registry, wire.p.metrics.registry
    opened = wire.clock.now
    outs = wire.submit("r", PROMPT, GREEDY)
    wire.tick(p=False)  # D opens the room and says Hello: P has not answered yet
    [room] = wire.d_role.by_room.values()
    assert room.opened == opened and room.requested is None
    wire.clock.advance(0.5)  # pairing (Hello, Register) takes half a second
    wire.run_until(lambda: room.requested is not None)
    assert room.requested == opened + 0.5
    wire.clock.advance(0.25)  # then P's prefill and the KV's writes a quarter
    wire.run_until(lambda: ended(outs))

    assert value(d, "pdserve_pd_requests_total", prefill="remote") == 1
    assert value(d, "pdserve_pd_requests_total", prefill="local") == 0
    kv_bytes = wire.p_role.stats.bytes_acked
    assert kv_bytes > 0
    assert value(d, "pdserve_pd_kv_bytes_count") == 1
    assert value(d, "pdserve_pd_kv_bytes_sum") == kv_bytes
    assert value(d, "pdserve_pd_kv_transfer_seconds_count") == 1
    assert value(d, "pdserve_pd_kv_transfer_seconds_sum") == 0.25
    assert value(d, "pdserve_pd_kv_wait_seconds_sum") == 0.75
    assert value(d, "pdserve_pd_kv_wait_seconds_bucket", le="0.5") == 0
    assert value(d, "pdserve_pd_kv_wait_seconds_bucket", le="1.0") == 1
    # P: one export done, as many bytes reported, nothing outstanding for the one peer.
    assert value(p, "pdserve_pd_exports_total", outcome="done") == 1
    for outcome in ("failed", "aborted", "rejected"):
        assert value(p, "pdserve_pd_exports_total", outcome=outcome) == 0
    assert value(p, "pdserve_pd_export_bytes_total") == kv_bytes
    assert value(p, "pdserve_pd_exports_outstanding", decode=D_ID) == 0
    # P's own time to first token: its queue and the prompt, within the quarter second
    assert value(p, "pdserve_time_to_first_token_seconds_count") == 1
    assert 0 <= value(p, "pdserve_time_to_first_token_seconds_sum") <= 0.25
    assert wire.idle()


def test_a_request_with_no_prefill_address_is_counted_local_and_shown_to_doctor(tiny_dir):
    wire = Wire(tiny_dir)
    outs: list[RequestOutput] = []
    wire.d.submit("loc", PROMPT, GREEDY, outs.append)  # no prefill: D computes the prompt
    wire.run_until(lambda: ended(outs))
    d = wire.d.metrics.registry
    assert outs[-1].finish_reason == "length"
    assert value(d, "pdserve_pd_requests_total", prefill="local") == 1
    assert value(d, "pdserve_pd_requests_total", prefill="remote") == 0
    assert value(d, "pdserve_pd_kv_bytes_count") == 0  # no KV came from a peer
    assert wire.sent == []
    wire.clock.advance(3.0)
    snap = wire.d_role.snapshot(wire.clock.now)["prefill"]
    assert snap == {"remote": 0, "local": 1, "last_local_age_s": 3.0, "first_tokens_ahead": 0}


def test_outstanding_exports_rise_while_p_works_and_end_by_outcome(tiny_dir):
    wire = Wire(tiny_dir)
    p = wire.p.metrics.registry
    long_params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    outs = wire.submit("r", PROMPT * 4, long_params)  # ten chunks: P computes for a while
    wire.run_until(lambda: bool(wire.p_role.by_room))
    assert value(p, "pdserve_pd_exports_outstanding", decode=D_ID) == 1
    wire.d.abort("r")
    wire.run_until(lambda: ended(outs) and wire.idle())
    assert value(p, "pdserve_pd_exports_outstanding", decode=D_ID) == 0
    assert value(p, "pdserve_pd_exports_total", outcome="aborted") == 1
    assert value(p, "pdserve_pd_exports_total", outcome="done") == 0
    # A PrefillRequest from a peer that never registered is refused: no room, counted.
    stranger = m.PrefillRequest(
        room=7, epoch=1, prompt_ids=[1, 2], dst_pages=[0], params=GREEDY, write_deadline=0.0
    )
    wire.p_role.handle(Inbound("stranger", stranger, ()), wire.clock.now)
    assert value(p, "pdserve_pd_exports_total", outcome="rejected") == 1
    assert value(p, "pdserve_pd_exports_outstanding", decode="stranger") is None


def test_role_metrics_render_under_their_names_beside_the_engines(tiny_dir):
    wire = Wire(tiny_dir)
    d_text, p_text = wire.d.metrics.render().decode(), wire.p.metrics.render().decode()
    for name in (
        "pdserve_pd_requests_total",
        "pdserve_pd_kv_bytes_bucket",
        "pdserve_pd_kv_transfer_seconds_bucket",
        "pdserve_pd_kv_wait_seconds_bucket",
        "pdserve_requests_running",  # the engine's own, in the same registry
    ):
        assert name in d_text, name
    for name in ("pdserve_pd_exports_total", "pdserve_pd_export_bytes_total"):
        assert name in p_text, name
    assert "pdserve_pd_requests_total" not in p_text
