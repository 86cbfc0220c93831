"""Per-request records -> the run's summary: latency percentiles, throughput, goodput, errors.

Definitions (times in the summary are milliseconds, rates per second of `duration_s`):
* latency stats cover the successful requests only; a failed request has no meaningful TTFT.
  ITL pools every gap of every successful request; TPOT is one value per request (see
  RequestRecord.tpot), so a long request counts once in TPOT and many times in ITL.
* percentiles interpolate linearly between the two nearest ranks (numpy's default method).
* output_throughput = output tokens of the successful requests / duration.
* tokens_per_chunk = output tokens / token events (SSE chunks with output), over the
  successful requests that had a token event: 1.0 when every token came in a chunk of its own;
  above it a stage of the server fell behind and merged what waited (vLLM and pdserve do), and
  the ITLs, one gap per chunk, grow with it.
* goodput = successful requests meeting every SLO set / duration; a one-token request has no
  TPOT and meets any TPOT objective.
* the run failed (`too_many_failures`) when failed / sent exceeds --max-failure-rate.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pdserve.bench.config import Slo
from pdserve.bench.record import RequestRecord

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty sequence, linearly interpolated."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats_ms(seconds: Sequence[float]) -> dict[str, float] | None:
    """mean, median, p90, p99 and max in milliseconds; None for no values."""
    if not seconds:
        return None
    ms = [x * 1000.0 for x in seconds]
    out = {"mean": sum(ms) / len(ms), "median": percentile(ms, 50.0)}
    for q in PERCENTILES[1:]:
        out[f"p{q:g}"] = percentile(ms, q)
    out["max"] = max(ms)
    out["count"] = float(len(ms))
    return out


def meets_slo(rec: RequestRecord, slo: Slo) -> bool:
    if not rec.ok or rec.ttft is None or rec.latency is None:
        return False
    if slo.ttft_ms is not None and rec.ttft * 1000.0 > slo.ttft_ms:
        return False
    tpot = rec.tpot
    if slo.tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo.tpot_ms:
        return False
    return not (slo.e2el_ms is not None and rec.latency * 1000.0 > slo.e2el_ms)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The summary of one run (or of one workload of it) over `duration_s` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.ok]
    errors = Counter(r.error_key for r in records if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    streamed = [r for r in ok if r.ttft is not None]  # had a token event: chunks to count
    chunks = sum(1 + len(r.itl) for r in streamed)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_throughput": out_tokens / duration_s,
        "tokens_per_chunk": sum(r.output_tokens for r in streamed) / chunks if chunks else None,
        "total_token_throughput": (out_tokens + in_tokens) / duration_s,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([t for t in (r.tpot for r in ok) if t is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": stats_ms([r.latency for r in ok if r.latency is not None]),
    }
    if not slo.empty:
        good = sum(1 for r in records if meets_slo(r, slo))
        summary["goodput"] = {
            "slo_ms": slo.as_dict(),
            "good_requests": good,
            "fraction": good / len(records) if records else 0.0,
            "requests_per_s": good / duration_s,
        }
    return summary


def summarize_run(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The whole run, plus one summary per workload when there is more than one."""
    summary = summarize(records, duration_s, slo)
    names = sorted({r.workload for r in records})
    if len(names) > 1:
        summary["workloads"] = {
            name: summarize([r for r in records if r.workload == name], duration_s, slo)
            for name in names
        }
    return summary


def too_many_failures(summary: dict[str, Any], max_failure_rate: float) -> str | None:
    """Why the run failed: more than `max_failure_rate` of its requests failed; else None."""
    sent, failed = int(summary["requests"]), int(summary["failed"])
    if sent == 0 or failed / sent <= max_failure_rate:
        return None
    kinds = ", ".join(f"{kind} {n}" for kind, n in summary["errors"].items())
    return (
        f"{failed} of {sent} requests failed ({100.0 * failed / sent:.1f}%: {kinds}), "
        f"more than --max-failure-rate {max_failure_rate:g} allows"
    )
