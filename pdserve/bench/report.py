"""The run's summary as a text table, and the JSON file with every per-request record.

The JSON is the source of truth (`summary` is derived from `records` by metrics.py and can
be recomputed from them); the table is for people.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pdserve.bench.runner import RunResult

_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def format_summary(summary: dict[str, Any], title: str = "pdserve bench") -> str:
    lines = [f"==== {title} ===="]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<34}{value:>14}")

    row("requests (completed / sent)", f"{summary['completed']} / {summary['requests']}")
    for key, n in summary["errors"].items():
        row(f"  failed: {key}", str(n))
    row("duration (s)", f"{summary['duration_s']:.2f}")
    row("request throughput (req/s)", f"{summary['request_throughput']:.2f}")
    row("output token throughput (tok/s)", f"{summary['output_throughput']:.1f}")
    row("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}")
    if summary.get("tokens_per_chunk") is not None:
        row("output tokens per chunk", f"{summary['tokens_per_chunk']:.3f}")
    goodput = summary.get("goodput")
    if goodput:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in goodput["slo_ms"].items())
        row(f"goodput (req/s) [{slo}]", f"{goodput['requests_per_s']:.2f}")
        row("  requests meeting the SLO", f"{100.0 * goodput['fraction']:.1f}%")
    for key, name in _LATENCIES:
        s = summary.get(key)
        if not s:
            continue
        lines.append(f"---- {name} (ms) ----")
        for stat in ("mean", "median", "p90", "p99", "max"):
            row(f"  {stat}", f"{s[stat]:.2f}")
    for name, sub in summary.get("workloads", {}).items():
        lines.append(format_summary(sub, title=f"workload {name}"))
    return "\n".join(lines)


def write_json(path: Path, config: dict[str, Any], result: RunResult) -> None:
    doc = {
        "config": config,
        "model": result.model,
        "warmup_errors": result.warmup_errors,
        "summary": result.summary,
        "pd": result.pd,  # how the router served the run (None: not a PD cluster)
        "records": [r.as_json() for r in result.records],  # in order of their start
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False))


def _finite(obj: Any) -> Any:
    """inf / nan -> strings, so that the file is strict JSON (--request-rate inf is common)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
