"""Pictures of a run: latency CDFs and throughput over time; and CDFs of several runs overlaid.

matplotlib is imported inside the functions, with the Agg backend (no display needed), so
that `pdserve bench` without --plot does not pay for it. Throughput over time counts token
events (one per SSE chunk, see client.py) in fixed bins; the figures are kept small (low dpi)
because they are committed next to the results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.record import RequestRecord

DPI = 80


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, seconds: Sequence[float], label: str | None = None) -> None:
    if not seconds:
        return
    ms = np.sort(np.asarray(seconds) * 1000.0)
    ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=label, linewidth=1.2)


def _latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.ok]
    return {
        "TTFT": [r.ttft for r in ok if r.ttft is not None],
        "ITL": [g for r in ok for g in r.itl],
        "E2E latency": [r.latency for r in ok if r.latency is not None],
    }


def plot_run(records: Sequence[RequestRecord], path: Path, title: str = "pdserve bench") -> None:
    """Three latency CDFs and output throughput over time, in one 2x2 figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, _latencies(records).items(), strict=False):
        _cdf(ax, values)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
    _throughput(axes.flat[3], records)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _throughput(ax: Any, records: Sequence[RequestRecord]) -> None:
    times = np.array([t for r in records for t in r.token_times()])
    ends = np.array([r.start + r.latency for r in records if r.ok and r.latency is not None])
    if times.size == 0:
        ax.set(title="throughput over time (no tokens)")
        return
    span = float(max(times.max(), ends.max() if ends.size else 0.0))
    width = max(0.25, span / 60.0)  # about 60 bins, none shorter than a quarter second
    edges = np.arange(0.0, span + width, width)
    tokens, _ = np.histogram(times, edges)
    done, _ = np.histogram(ends, edges)
    ax.step(edges[:-1], tokens / width, where="post", label="output tokens/s")
    ax.set(title="throughput over time", xlabel="seconds from start", ylabel="tokens/s")
    twin = ax.twinx()
    twin.step(edges[:-1], done / width, where="post", color="tab:orange", label="requests/s")
    twin.set_ylabel("completed requests/s")
    ax.legend(loc="upper left", fontsize="small")
    twin.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)


def plot_compare(
    runs: Mapping[str, Sequence[RequestRecord]],
    path: Path,
    title: str,
    itl_workload: str | None = None,
    ttft_workload: str | None = None,
) -> None:
    """Several runs overlaid: the ITL tail (1 - CDF, log scale, where p99 and beyond are
    visible) and the TTFT CDF, each of one workload's requests or of all of them."""
    plt = _pyplot()
    fig, (a_itl, a_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for name, records in runs.items():
        itl = [r for r in records if itl_workload is None or r.workload == itl_workload]
        ttft = [r for r in records if ttft_workload is None or r.workload == ttft_workload]
        _ccdf(a_itl, _latencies(itl)["ITL"], name)
        _cdf(a_ttft, _latencies(ttft)["TTFT"], name)
    scope_itl = f"{itl_workload} requests" if itl_workload else "all requests"
    scope_ttft = f"{ttft_workload} requests" if ttft_workload else "all requests"
    a_itl.set(
        title=f"ITL tail ({scope_itl})",
        xlabel="ITL (ms)",
        ylabel="fraction of gaps longer (log)",
        yscale="log",
    )
    a_itl.axhline(0.01, color="grey", linewidth=0.6, linestyle="--")  # p99
    a_ttft.set(title=f"TTFT CDF ({scope_ttft})", xlabel="TTFT (ms)", ylabel="fraction")
    a_ttft.axhline(0.99, color="grey", linewidth=0.6, linestyle="--")
    for ax in (a_itl, a_ttft):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _ccdf(ax: Any, seconds: Sequence[float], label: str) -> None:
    if not seconds:
        return
    ms = np.sort(np.asarray(seconds) * 1000.0)
    above = 1.0 - np.arange(1, len(ms) + 1) / len(ms)
    keep = above > 0  # the last point has nothing above it; log scale cannot show 0
    ax.plot(ms[keep], above[keep], label=label, linewidth=1.2)
