"""The worker-facing HTTP API: what a router calls on a worker that owns requests.

    POST /generate   {"request_id", "prompt_ids", "params": {SamplingParams fields},
                      "timeout_s"?, "prefill"?}  ->  NDJSON stream, one RequestOutput per line
                     (pdserve/protocol/outputs.py): {"request_id", "token_ids": [...],
                      "logprobs": [[id, lp, [[id, lp], ...]], ...], "finish_reason": null |
                      "stop" | "length" | "abort" | "error", "error", "num_prompt_tokens"}
    POST /outputs    {"channel"}  ->  NDJSON stream of RequestOutput lines of every request sent
                     with "channel" (worker/channels.py: the router holds one per worker)
    POST /generate   {..., "channel"}  ->  {"ok": true} once the engine has the request; its
                     outputs go to that channel's stream (503 `channel_closed`: it never
                     reached the engine)
    POST /abort      {"request_id"} or {"request_ids": [...]} (at most MAX_ABORT_IDS)  ->
                     {"ok": true}
    GET  /info       role, model, max_model_len, vocab size, layout

A request's last line always carries a finish_reason. A client that disconnects aborts its
request (a channel's: every request it carries). Served by co-located workers and decode
workers alike. Every field of a body is checked before the engine sees it (the engine thread
would fail on a string seed or a list for an address): the same body and SamplingParams
checks as the OpenAI API, plus the request id, the timeout and the prefill address. The params
are SamplingParams' wire form (`SamplingParams.from_builtins`), as in a PrefillRequest.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from typing import Any

from aiohttp import web

from pdserve.frontend.api import read_json
from pdserve.frontend.protocol import ApiError, bad, check_timeout
from pdserve.protocol.outputs import MAX_ABORT_IDS, RequestOutput, encode_lines
from pdserve.protocol.sampling import InvalidParams, SamplingParams, is_int, show
from pdserve.runtime.timing import STREAM_GRACE_S
from pdserve.server.output_stream import OutputStream, StreamTimeout, handoff, merge_runs
from pdserve.worker.channels import TIMED_OUT, ChannelError, Channels

MAX_REQUEST_ID_CHARS = 256
MAX_ADDRESS_CHARS = 270  # "tcp://" + a 253-character host name + ":65535"
GENERATE_KEYS = frozenset({"request_id", "prompt_ids", "params", "timeout_s", "prefill", "channel"})
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ADDRESS = re.compile(
    rf"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|{_LABEL}(?:\.{_LABEL})*):(?P<port>[0-9]{{1,5}})"
)


def params_from_json(d: Any) -> SamplingParams:
    """A router's or a peer's params -> SamplingParams (`SamplingParams.from_builtins`);
    anything wrong is ApiError 400 naming the field, and nothing else is raised."""
    try:
        return SamplingParams.from_builtins(d)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    """SamplingParams' wire form (`to_builtins`), for a /generate body or a PrefillRequest."""
    return p.to_builtins()


def check_request_id(v: Any, field: str = "request_id") -> str:
    """A request's (or a channel's) id: a printable string of 1 to 256 characters."""
    if not (isinstance(v, str) and 0 < len(v) <= MAX_REQUEST_ID_CHARS and v.isprintable()):
        raise bad(
            f"'{field}' must be a printable string of 1 to {MAX_REQUEST_ID_CHARS} "
            f"characters, got {show(v)}",
            field,
        )
    return v


def _channel_error(e: ChannelError) -> web.Response:
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    err = ApiError(e.status, e.message, type_=kind, code=e.code)
    return web.json_response(err.body(), status=e.status)


def check_prefill_address(v: Any) -> str:
    """A prefill worker's control address as the router sends it: tcp://HOST:PORT, HOST a
    host name, an IPv4 address or a bracketed IPv6 address."""
    m = _ADDRESS.fullmatch(v) if isinstance(v, str) and len(v) <= MAX_ADDRESS_CHARS else None
    ok = m is not None and 1 <= int(m["port"]) <= 65535
    if ok and m is not None and m["host"].startswith("["):
        try:
            ipaddress.IPv6Address(m["host"][1:-1])
        except ValueError:
            ok = False
    if not ok:
        raise bad(
            f"'prefill' must be a control address tcp://HOST:PORT (port 1 to 65535), got {show(v)}",
            "prefill",
        )
    return str(v)


class WorkerApi:
    """`engine` is anything with validate/submit/abort, max_model_len, vocab_size."""

    def __init__(self, engine: Any, role: str, model_name: str, info: dict[str, Any]) -> None:
        self.engine = engine
        self.role = role
        self.model_name = model_name
        self.info_extra = info
        self.channels = Channels()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/outputs", self.outputs),
            web.post("/generate", self.generate),
            web.post("/abort", self.abort),
            web.get("/info", self.info),
        ]

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "role": self.role,
                "model": self.model_name,
                "max_model_len": self.engine.max_model_len,
                "vocab_size": self.engine.vocab_size,
                **self.info_extra,
            }
        )

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict) or len(body) != 1:
                known = ("request_id", "request_ids")
                extra = sorted(k for k in body if k not in known) if isinstance(body, dict) else []
                raise bad(
                    "the body must be {'request_id': str} or {'request_ids': [str, ...]}",
                    extra[0] if extra else "request_id",
                )
            if "request_ids" in body:
                ids = body["request_ids"]
                if not isinstance(ids, list) or not 0 < len(ids) <= MAX_ABORT_IDS:
                    raise bad(
                        f"'request_ids' must be a list of 1 to {MAX_ABORT_IDS} request ids",
                        "request_ids",
                    )
                rids = [check_request_id(v, "request_ids") for v in ids]
            else:
                rids = [check_request_id(body.get("request_id"))]
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        for rid in dict.fromkeys(rids):  # checked, all of them, before any reaches the engine
            self.engine.abort(rid)
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise bad("the request body must be a JSON object")
            unknown = sorted(k for k in body if k not in GENERATE_KEYS)
            if unknown:
                raise bad(f"unknown fields {show(unknown)}", unknown[0])
            rid = check_request_id(body.get("request_id"))
            prompt = body.get("prompt_ids")
            if not isinstance(prompt, list) or not all(is_int(t) for t in prompt):
                raise bad("'prompt_ids' must be a list of integers", "prompt_ids")
            params = params_from_json(body.get("params", {}))
            timeout = check_timeout(body.get("timeout_s"), "timeout_s")
            prefill = check_prefill_address(body["prefill"]) if "prefill" in body else None
            cid = check_request_id(body["channel"], "channel") if "channel" in body else None
            try:
                self.engine.validate(prompt, params)
            except InvalidParams as e:
                raise bad(str(e), e.param) from e
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        loop = asyncio.get_running_loop()
        wait_s = (timeout or self.engine.cfg.request_timeout_s) + STREAM_GRACE_S
        extra = {"prefill": prefill} if self.role == "decode" and prefill is not None else {}
        push = handoff(loop).push
        if cid is not None:
            try:
                ch = self.channels.admit(cid, rid, wait_s)
            except ChannelError as e:
                return _channel_error(e)
            put = ch.put
            try:
                self.engine.submit(rid, prompt, params, lambda o: push(put, o), timeout, **extra)
            except BaseException:
                ch.discard(rid)  # the engine never took it
                raise
            return web.json_response({"ok": True})
        stream: OutputStream[RequestOutput] = OutputStream(loop, loop.time() + wait_s)
        put = stream.put
        self.engine.submit(rid, prompt, params, lambda o: push(put, o), timeout, **extra)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        finished = False
        try:
            await resp.prepare(request)
            while not finished:
                # Everything that came while the last write waited goes out as one line.
                try:
                    outs = merge_runs(await stream.take())
                except StreamTimeout:
                    outs = [RequestOutput(rid, (), (), "error", TIMED_OUT)]
                finished = any(o.finish_reason is not None for o in outs)
                await resp.write(encode_lines(outs))
            await resp.write_eof()
        finally:
            stream.close()
            if not finished:
                self.engine.abort(rid)
        return resp

    async def outputs(self, request: web.Request) -> web.StreamResponse:
        """A router's shared output stream (worker/channels.py), open until it closes it or
        the worker stops."""
        try:
            body = await read_json(request)
            if not isinstance(body, dict) or set(body) != {"channel"}:
                raise bad("the body must be {'channel': str}", "channel")
            cid = check_request_id(body["channel"], "channel")
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        try:
            ch = self.channels.open(asyncio.get_running_loop(), cid, self.engine.abort)
        except ChannelError as e:
            return _channel_error(e)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await resp.prepare(request)  # the router sends requests once it has these headers
            await ch.serve(resp)
        finally:
            ch.close()
            self.channels.remove(ch)
        return resp
