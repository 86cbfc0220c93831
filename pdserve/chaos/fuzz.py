"""`pdserve chaos --scenario fuzz`: seeded hostile requests against a live cluster.

The cases come from chaos/fuzz_cases.py (valid requests, valid requests with one field made
hostile, raw bodies that are not JSON, wrong content types, methods and paths, compressed
bodies good, broken and explosive, Authorization headers that are not UTF-8, timeouts of a
microsecond, a prompt of one word of megabytes, connections reset right after the request),
sent with a bounded concurrency, each with its own client timeout. Every answer is checked as
it comes:
* never a 5xx (the report counts them: `five_xx`, which must be 0); every 4xx an
  OpenAI-style JSON body `{"error": {"message", "type", "param", "code"}}`; a case that names
  its statuses gets one of them;
* a valid case is a 200 with a finished completion (a stream ends with [DONE] and no error);
* nothing hangs past the client timeout.
A reset case has no answer to check; the quiet check below sees what it left behind.
Afterwards: the router's /health is green, every worker's /debug/invariants holds (nothing
live, every page free, every thread alive), and a fixed greedy request answers exactly as it
did before the fuzz. Any miss is a violation; the seed replays the run.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdserve.chaos import probes
from pdserve.chaos.cluster import ClusterSpec, WorkerRef
from pdserve.chaos.fuzz_cases import Case, Expect, Send, cases
from pdserve.chaos.resets import reset_one
from pdserve.chaos.scenarios import ChaosOptions, Context, Outcome
from pdserve.runtime import httpcall

CONCURRENCY = 8
CASE_TIMEOUT_S = 60.0  # a valid case asks for at most 6 tokens: far below this
# Token ids of valid cases are drawn below this: every model pdserve serves has more (the
# built-in byte-level tokenizers start with 256 byte tokens).
VALID_VOCAB = 256
COMPLETIONS = frozenset({"/v1/completions", "/v1/chat/completions"})
ERROR_FIELDS = frozenset({"message", "type", "param", "code"})
PROBE = {"prompt": "The fuzzer checks:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@dataclass
class FuzzReport:
    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # "200", "400", "timeout", ...
    valid: int = 0
    valid_ok: int = 0
    violations: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "statuses": dict(self.statuses),
            "valid": self.valid,
            "valid_ok": self.valid_ok,
            "five_xx": sum(n for s, n in self.statuses.items() if s.startswith("5")),
            "hangs": self.statuses.get("timeout", 0),
            "duration_s": round(self.duration_s, 1),
        }


def check(case: Case, status: int, raw: bytes) -> str | None:
    """What is wrong with this answer to this case, or None."""
    text = raw.decode("utf-8", errors="replace")
    if status >= 500:
        return f"HTTP {status}: {text[:200]}"
    if case.statuses and status not in case.statuses:
        return f"HTTP {status} where {sorted(case.statuses)} was due: {text[:200]}"
    if status >= 400:
        try:
            error = json.loads(text)["error"]
            fields, message = set(error), error["message"]
        except (ValueError, KeyError, TypeError):
            return f"HTTP {status} without an OpenAI error body: {text[:200]}"
        if not fields >= ERROR_FIELDS:
            return f"HTTP {status}: the error body lacks {sorted(ERROR_FIELDS - fields)}"
        return None if isinstance(message, str) and message else f"empty error: {text[:200]}"
    if status != 200:
        return f"HTTP {status}"
    if case.path not in COMPLETIONS:
        return None  # /v1/models, /health, /debug/*: answered, which is all an odd call asks
    if case.stream:
        lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            return f"a stream that did not end with [DONE]: {text[-200:]}"
        events = [json.loads(ln) for ln in lines[:-1]]
        if case.expect is Expect.VALID and any("error" in e for e in events):
            return f"a valid stream carried an error event: {text[:300]}"
        return None
    try:
        choices = json.loads(text)["choices"]
    except (ValueError, KeyError, TypeError):
        return f"a 200 that is not a completion: {text[:200]}"
    if case.expect is Expect.VALID:
        ends = {c.get("finish_reason") for c in choices}
        if not choices or not ends <= {"stop", "length"}:
            return f"a valid request ended with {ends}: {text[:200]}"
    return None


async def _send(session: aiohttp.ClientSession, base: str, case: Case) -> tuple[str, str | None]:
    """(the status or what happened instead, what is wrong with it or None)."""
    match case.send:
        case Send.RAW:
            return await asyncio.to_thread(_send_raw, base, case, dict(session.headers))
        case Send.RESET:
            return await _send_reset(base, case, dict(session.headers))
    try:
        async with session.request(
            case.method,
            base + case.path,
            data=case.body,
            headers=case.headers,
            timeout=aiohttp.ClientTimeout(total=CASE_TIMEOUT_S),
        ) as r:
            raw = await r.read()
            return str(r.status), check(case, r.status, raw)
    except TimeoutError:
        return "timeout", f"no answer within {CASE_TIMEOUT_S:.0f}s"
    except aiohttp.ClientError as e:
        return "connection_error", f"connection failed: {e!r}"


def _send_raw(base: str, case: Case, common: dict[str, str]) -> tuple[str, str | None]:
    """A case sent by http.client, which writes header values as latin-1: any byte goes out as
    it is (aiohttp's client writes UTF-8)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=CASE_TIMEOUT_S)
    try:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        for name, value in {**common, **case.headers}.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(case.body)))
        conn.endheaders(case.body)
        r = conn.getresponse()
        raw = r.read()
        return str(r.status), check(case, r.status, raw)
    except TimeoutError:
        return "timeout", f"no answer within {CASE_TIMEOUT_S:.0f}s"
    except (OSError, http.client.HTTPException) as e:
        return "connection_error", f"connection failed: {e!r}"
    finally:
        conn.close()


async def _send_reset(base: str, case: Case, common: dict[str, str]) -> tuple[str, str | None]:
    """A case written on a socket whole, then reset (RST) at once: the server finds its client
    gone before it could answer. Nothing comes back to check."""
    u = urlsplit(base)
    head = [f"{case.method} {case.path} HTTP/1.1", f"Host: {u.hostname}:{u.port}"]
    head += [f"{k}: {v}" for k, v in {**common, **case.headers}.items()]
    head += [f"Content-Length: {len(case.body)}"]
    payload = ("\r\n".join(head) + "\r\n\r\n").encode() + case.body
    try:
        async with asyncio.timeout(CASE_TIMEOUT_S):
            await reset_one(base, "plain-sent", payload)
    except (OSError, TimeoutError) as e:
        return "connection_error", f"connection failed: {e!r}"
    return "reset", None


async def fuzz(
    base: str, model: str, vocab: int, seed: int, n: int, headers: dict[str, str] | None = None
) -> FuzzReport:
    """Send `n` seeded cases to the server at `base`; the report holds every violation.
    `headers`: sent with every case (an API key, if the server has one)."""
    report = FuzzReport()
    todo = list(cases(seed, n, model, vocab))
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(keepalive_timeout=2.5)  # below the servers' 5 s idle close
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(case: Case) -> None:
            async with sem:
                status, problem = await _send(session, base, case)
            report.sent += 1
            report.statuses[status] += 1
            if case.expect is Expect.VALID:
                report.valid += 1
                if problem is None and status == "200":
                    report.valid_ok += 1
                elif problem is None:
                    problem = f"a valid request was refused with HTTP {status}"
            if problem is not None:
                report.violations.append(f"case {case.index} ({case.kind}): {problem}")

        await asyncio.gather(*(one(c) for c in todo))
    report.duration_s = time.monotonic() - t0
    return report


def probe(base: str) -> tuple[str, list[str]] | str:
    """The fixed greedy request's text and tokens, or what went wrong."""
    r = httpcall.post(base + "/v1/completions", {**PROBE, "logprobs": 0}, 60.0)
    if not r.ok or not isinstance(r.body, dict):
        return f"HTTP {r.status}: {r.error or str(r.body)[:200]}"
    choice = r.body["choices"][0]
    return choice["text"], list(choice["logprobs"]["tokens"])


def served_model(base: str) -> str:
    r = httpcall.get(base + "/v1/models", 10.0)
    if not r.ok or not isinstance(r.body, dict):
        raise RuntimeError(f"GET {base}/v1/models: {r.error or r.status}")
    return str(r.body["data"][0]["id"])


class Fuzz:
    name = "fuzz"
    destructive = False
    needs_launch = False

    def spec(self, opts: ChaosOptions) -> ClusterSpec | None:
        return opts.base_spec()

    def unfit(self, workers: list[WorkerRef]) -> str | None:
        return None

    def run(self, ctx: Context, out: Outcome) -> None:
        base = ctx.cluster.url
        model = served_model(base)
        before = probe(base)
        if isinstance(before, str):
            out.violate(f"the probe request failed before the fuzz: {before}")
            return
        n = ctx.opts.requests
        ctx.say(f"sending {n} cases (seed {ctx.opts.seed}) with concurrency {CONCURRENCY}")
        report = asyncio.run(fuzz(base, model, VALID_VOCAB, ctx.opts.seed, n))
        for v in report.violations[:200]:
            out.violate(v)
        if len(report.violations) > 200:
            out.violate(f"... and {len(report.violations) - 200} more")
        health = httpcall.get(base + "/health", 10.0)
        if health.status != 200:
            out.violate(f"router /health after the fuzz: {health.status} {health.body}")
        quiet = probes.wait_quiet(base, [w.url for w in ctx.workers()], ctx.opts.quiet_bound_s)
        out.violations += [f"not quiet after the fuzz: {v}" for v in quiet.violations]
        after = probe(base)
        if after != before:
            out.violate(f"the probe request answers differently after the fuzz: {after}")
        s = report.summary()
        if s["five_xx"]:  # each is a violation above too; this one says how many in all
            out.violate(f"{s['five_xx']} of {s['sent']} answers were 5xx; 0 are allowed")
        out.summary.update(s)
        out.summary["headline"] = (
            f"{s['sent']} cases, {s['valid_ok']}/{s['valid']} valid served, "
            f"{s['five_xx']} x 5xx, {s['hangs']} hangs, statuses {s['statuses']}, "
            f"quiet after {quiet.after_s}s, {s['duration_s']}s"
        )
