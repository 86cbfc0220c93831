"""The engine's step-batched histogram exports exactly what per-observation `observe` does."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.engine.metrics import EngineMetrics, StepHistogram
from pdserve.runtime.timing import LATENCY_BUCKETS


def _render_without_created(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_step_histogram_renders_as_plain_observes():
    values = [0.0, 1e-4, 0.001, 0.0049, 0.005, 0.02, 0.5, 1.0, 7.5, 59.0, 1e6]
    values += [b for b in LATENCY_BUCKETS]  # exactly on each bound: that bucket, as observe
    plain_r, step_r = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("x_seconds", "doc", buckets=LATENCY_BUCKETS, registry=plain_r)
    step = StepHistogram("x_seconds", "doc", LATENCY_BUCKETS, step_r)
    for v in values[:7]:
        plain.observe(v)
        step.observe(v)
    assert _render_without_created(step_r) != _render_without_created(plain_r)  # not flushed
    step.flush()
    for v in values[7:]:
        plain.observe(v)
        step.observe(v)
    step.flush()
    step.flush()  # nothing new: changes nothing
    assert _render_without_created(step_r) == _render_without_created(plain_r)


def test_the_engine_exports_the_inter_token_latency_under_its_name():
    m = EngineMetrics()
    m.itl.observe(0.01)
    m.itl.flush()
    text = m.render().decode()
    assert "pdserve_inter_token_latency_seconds_count 1.0" in text
    assert 'pdserve_inter_token_latency_seconds_bucket{le="+Inf"} 1.0' in text
