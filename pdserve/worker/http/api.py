"""The worker-facing HTTP API: what a router calls on a worker that owns requests.

    POST /generate   {"request_id", "prompt_ids", "params": {SamplingParams fields},
                      "timeout_s"?, "prefill"?}  ->  NDJSON stream, one RequestOutput per line
                     (pdserve/protocol/outputs.py): {"request_id", "token_ids": [...],
                      "logprobs": [[id, lp, [[id, lp], ...]], ...], "finish_reason": null |
                      "stop" | "length" | "abort" | "error", "error", "num_prompt_tokens"}
    POST /outputs    {"channel"}  ->  NDJSON stream of RequestOutput lines of every request sent
                     with "channel" (worker/http/channels.py: the router holds one per worker)
    POST /generate   {..., "channel"}  ->  {"ok": true} once the engine has the request; its
                     outputs go to that channel's stream (503 `channel_closed`: it never
                     reached the engine)
    POST /abort      {"request_id"} or {"request_ids": [...]} (at most MAX_ABORT_IDS)  ->
                     {"ok": true}
    GET  /info       role, model, max_model_len, vocab size, layout

A request's last line always carries a finish_reason. A client that disconnects aborts its
request (a channel's: every request it carries). Served by co-located workers and decode
workers alike. Every field of a body is checked before the engine sees it (the engine thread
would fail on a string seed or a list for an address). /generate's body is
protocol/generate.py's `Generate`, read by its one decoder (`decode_generate`); whether the
model can serve the request is the engine's own check, which `engine.submit` runs before it
takes anything (InvalidParams, answered 400 like a bad field).

A body's constraint is decoded with it on the loop (a cheap check); whether it compiles, which
waits on the grammar thread, is checked on the constraint threads
(frontend/constraint_threads.py), so the loop serves every other request's stream meanwhile
and a constraint that cannot compile is a 400 here too.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from pdserve.frontend.api import read_json
from pdserve.frontend.constraint_threads import ConstraintThreads
from pdserve.frontend.protocol import ApiError, bad
from pdserve.frontend.structured import check_constraint
from pdserve.protocol.generate import check_request_id, decode_generate
from pdserve.protocol.outputs import MAX_ABORT_IDS, RequestOutput, encode_lines
from pdserve.protocol.sampling import InvalidParams
from pdserve.runtime.timing import STREAM_GRACE_S
from pdserve.server.body import read_body
from pdserve.server.json_body import utf8_body
from pdserve.server.output_stream import OutputStream, StreamTimeout, handoff, merge_runs
from pdserve.worker.http.aborted_ids import AbortedIds
from pdserve.worker.http.channels import TIMED_OUT, ChannelError, Channels


def _refused(e: ApiError | InvalidParams) -> web.Response:
    """The 400 (or other) answer to a request refused before the engine took it."""
    err = bad(str(e), e.param) if isinstance(e, InvalidParams) else e
    return web.json_response(err.body(), status=err.status)


def _channel_error(e: ChannelError) -> web.Response:
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    err = ApiError(e.status, e.message, type_=kind, code=e.code)
    return web.json_response(err.body(), status=e.status)


class WorkerApi:
    """`engine` is anything with submit/abort, cfg, max_model_len, vocab_size; `submit` raises
    InvalidParams for a request the engine can never serve, before taking it."""

    def __init__(self, engine: Any, role: str, model_name: str, info: dict[str, Any]) -> None:
        self.engine = engine
        self.role = role
        self.model_name = model_name
        self.info_extra = info
        self.channels = Channels()
        self.aborted = AbortedIds()  # an abort can overtake its /generate
        self.constraints = ConstraintThreads()  # decodes bodies that hold a constraint

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
        except (ApiError, InvalidParams) as e:
            return _refused(e)
        now = time.monotonic()
        for rid in dict.fromkeys(rids):  # checked, all of them, before any reaches the engine
            self.aborted.add(rid, now)
            self.engine.abort(rid)
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = utf8_body(await read_body(request), request.charset)
            g = decode_generate(raw)
            if g.params.constraint is not None:  # its compile check waits: off the loop
                await self.constraints.run(check_constraint, g.params.constraint)
        except (ApiError, InvalidParams) as e:
            return _refused(e)
        rid, prompt, params, timeout = g.request_id, g.prompt_ids, g.params, g.timeout_s
        if self.aborted.refuse(rid, time.monotonic()):
            err = ApiError(409, f"request {rid} was aborted before it arrived", code="aborted")
            return web.json_response(err.body(), status=409)
        loop = asyncio.get_running_loop()
        wait_s = (timeout or self.engine.cfg.request_timeout_s) + STREAM_GRACE_S
        prefill = g.prefill if isinstance(g.prefill, str) else None
        extra = {"prefill": prefill} if self.role == "decode" and prefill is not None else {}
        push = handoff(loop).push
        if isinstance(g.channel, str):
            try:
                ch = self.channels.admit(g.channel, rid, wait_s)
            except ChannelError as e:
                return _channel_error(e)
            put = ch.put
            try:
                self.engine.submit(rid, prompt, params, lambda o: push(put, o), timeout, **extra)
            except InvalidParams as e:
                ch.discard(rid)  # the engine never took it
                return _refused(e)
            except BaseException:
                ch.discard(rid)
                raise
            return web.json_response({"ok": True})
        stream: OutputStream[RequestOutput] = OutputStream(loop, loop.time() + wait_s)
        put = stream.put
        try:
            self.engine.submit(rid, prompt, params, lambda o: push(put, o), timeout, **extra)
        except InvalidParams as e:
            stream.close()
            return _refused(e)
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
        """A router's shared output stream (worker/http/channels.py), open until it closes it or
        the worker stops."""
        try:
            body = await read_json(request)
            if not isinstance(body, dict) or set(body) != {"channel"}:
                raise bad("the body must be {'channel': str}", "channel")
            cid = check_request_id(body["channel"], "channel")
        except (ApiError, InvalidParams) as e:
            return _refused(e)
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
