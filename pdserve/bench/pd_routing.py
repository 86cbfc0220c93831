"""The report's "PD" block: how the router under test served the run's requests.

A PD cluster that silently serves requests decode-only (no prefill worker) still answers,
only slower; the router counts each request by how it is served
(`pdserve_router_routed_requests_total{mode}`: `pd`, `decode_only`, `colocated`). Bench
scrapes the router's /metrics before the warm-up and after the run and reports the
difference: the requests routed in that window, the warm-up's included, and any other
client's (the counter is the router's, not this run's).

The block never fails a run. A /metrics that needs a key bench was not given (the router's
--protect-health), one that does not answer, or a server that is not a pdserve router (no
such counter) gives a note instead; a router that has never routed a request through a
prefill pool (a co-located fleet) gives no block at all.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROUTED = "pdserve_router_routed_requests"
MODES = ("pd", "decode_only", "colocated")
SCRAPE_TIMEOUT_S = 5.0

Counts = dict[str, float]  # mode -> requests routed so far


def parse_routed(text: str) -> Counts | None:
    """The routed-request counts by mode in Prometheus text; None without the counter."""
    for family in text_string_to_metric_families(text):
        if family.name == ROUTED:  # the parser names a counter's family without _total
            return {
                str(s.labels.get("mode")): s.value
                for s in family.samples
                if s.name == ROUTED + "_total"
            }
    return None


def scrape(url: str, headers: dict[str, str], timeout_s: float = SCRAPE_TIMEOUT_S) -> Counts | str:
    """The router's counts from `url`/metrics, or why there are none (a note, in words)."""
    where = url.rstrip("/") + "/metrics"
    req = urllib.request.Request(where, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return f"{where} needs a key (the router's --protect-health): pass its --api-key"
        return f"{where} answered HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
        return f"{where}: no answer ({getattr(e, 'reason', e)})"
    try:
        counts = parse_routed(text)
    except ValueError as e:  # not Prometheus text
        return f"{where} is not Prometheus text ({e})"
    if counts is None:
        return f"{where} has no {ROUTED}_total (not a pdserve router)"
    return counts


def pd_block(before: Counts | str, after: Counts | str, warmup: int) -> dict[str, Any] | None:
    """The block for the report and the JSON file: {"routed": {mode: n}, "decode_only_fraction"}
    in the window, or {"note": why there is none}; None for a router that never routed
    through a prefill pool (nothing PD to show)."""
    if isinstance(before, str):
        return {"note": before}
    if isinstance(after, str):
        return {"note": after}
    if not (after.get("pd") or after.get("decode_only")):
        return None
    routed = {m: round(after.get(m, 0.0) - before.get(m, 0.0)) for m in MODES}
    served = routed["pd"] + routed["decode_only"]
    return {
        "routed": routed,
        "decode_only_fraction": routed["decode_only"] / served if served else None,
        "warmup_requests": warmup,  # included in the counts
    }


def format_pd(block: dict[str, Any]) -> str:
    """The block as the report's text rows (the summary table's widths)."""
    if "note" in block:
        return f"---- PD ----\n  no PD counts: {block['note']}"
    routed = block["routed"]
    lines = [f"---- PD (router, warm-up's {block['warmup_requests']} included) ----"]
    rows = [("requests routed pd", str(routed["pd"]))]
    rows.append(("requests routed decode-only", str(routed["decode_only"])))
    fraction = block["decode_only_fraction"]
    if fraction is not None:
        rows.append(("  decode-only share", f"{100.0 * fraction:.1f}%"))
    lines += [f"{name:<34}{value:>14}" for name, value in rows]
    return "\n".join(lines)
