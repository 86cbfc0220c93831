"""One streamed request against an OpenAI-compatible server -> one RequestRecord.

Every failure is an ErrorKind in the record, never an exception out of `send`: a benchmark
records what went wrong and carries on. The stream is read in whatever pieces the network
delivers rather than line by line through aiohttp (a fifth fewer Python calls per request in
a profile of benchmarks/serving/bench_overhead.py's run), and stream.py makes sense of the lines.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from pdserve.bench.config import ClientConfig
from pdserve.bench.dataset import BenchRequest
from pdserve.bench.record import ErrorKind, RequestRecord
from pdserve.bench.stream import StreamParser, fail


def request_body(cfg: ClientConfig, model: str | None, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
    return body


def encode_body(cfg: ClientConfig, model: str | None, req: BenchRequest) -> bytes:
    return json.dumps(request_body(cfg, model, req)).encode()


_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


async def send(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    body: bytes,
    rec: RequestRecord,
    t0: float,
) -> RequestRecord:
    """Stream one request (`body`: encoded JSON) and fill `rec`; `t0` is the run's start on
    perf_counter's clock."""
    sent = time.perf_counter()
    rec.start = sent - t0
    try:
        async with session.post(
            cfg.api_url, data=body, headers=_HEADERS, timeout=cfg.timeout
        ) as resp:
            if resp.status != 200:
                rec.http_status = resp.status
                fail(rec, ErrorKind.HTTP, (await resp.text())[:300])
            else:
                await _read_stream(resp, rec, sent)
    except TimeoutError as e:  # before ClientError: aiohttp's timeouts are both
        fail(rec, ErrorKind.TIMEOUT, f"no answer within the timeout ({type(e).__name__})")
    except (aiohttp.ClientError, OSError) as e:
        fail(rec, ErrorKind.CONNECTION, f"{type(e).__name__}: {e}")
    rec.latency = time.perf_counter() - sent
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, sent: float) -> None:
    parser = StreamParser(rec, sent)
    pending = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if parser.line(line, now):
                parser.finish()
                return
    if pending:
        parser.line(pending, time.perf_counter())
    parser.finish()
