"""The worker-facing HTTP API: what a router calls on a worker that owns requests.

    POST /generate   {"request_id", "prompt_ids", "params": {SamplingParams fields},
                      "timeout_s"?, "prefill"?}  ->  NDJSON stream, one RequestOutput per line:
                     {"token_ids": [...], "logprobs": [[id, lp, [[id, lp], ...]], ...],
                      "finish_reason": null | "stop" | "length" | "abort" | "error", "error": ...}
    POST /abort      {"request_id"}  ->  {"ok": true}
    GET  /info       role, model, max_model_len, vocab size, layout

The stream's last line always carries a finish_reason. A client that disconnects aborts its
request. Served by co-located workers and decode workers alike.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from pdserve.engine.params import InvalidParams, SamplingParams
from pdserve.engine.request import RequestOutput
from pdserve.server.openai_protocol import ApiError, bad

GRACE_S = 10.0


def output_to_json(o: RequestOutput) -> dict[str, Any]:
    return {
        "token_ids": list(o.token_ids),
        "logprobs": [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in o.logprobs],
        "finish_reason": o.finish_reason,
        "error": o.error,
        "num_prompt_tokens": o.num_prompt_tokens,
    }


def params_from_json(d: Any) -> SamplingParams:
    if not isinstance(d, dict):
        raise bad("'params' must be an object", "params")
    fields = set(SamplingParams.__dataclass_fields__)
    unknown = set(d) - fields
    if unknown:
        raise bad(f"unknown sampling params {sorted(unknown)}", "params")
    kw = dict(d)
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    try:
        return SamplingParams(**kw)
    except InvalidParams as e:
        raise bad(str(e), e.param) from e
    except TypeError as e:
        raise bad(f"bad sampling params: {e}", "params") from e


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    d = {k: getattr(p, k) for k in SamplingParams.__dataclass_fields__}
    d["stop_token_ids"] = list(p.stop_token_ids)
    return d


class WorkerApi:
    """`engine` is anything with validate/submit/abort, max_model_len, vocab_size."""

    def __init__(self, engine: Any, role: str, model_name: str, info: dict[str, Any]) -> None:
        self.engine = engine
        self.role = role
        self.model_name = model_name
        self.info_extra = info

    def routes(self) -> list[web.RouteDef]:
        return [
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
            body = await request.json()
            rid = body["request_id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return web.json_response(bad("body must be {'request_id': str}").body(), status=400)
        self.engine.abort(str(rid))
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response(bad(f"invalid JSON: {e}").body(), status=400)
        try:
            if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
                raise bad("'request_id' (string) is required", "request_id")
            prompt = body.get("prompt_ids")
            if not isinstance(prompt, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                raise bad("'prompt_ids' must be a list of integers", "prompt_ids")
            params = params_from_json(body.get("params", {}))
            timeout = body.get("timeout_s")
            try:
                self.engine.validate(prompt, params)
            except InvalidParams as e:
                raise bad(str(e), e.param) from e
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        rid = body["request_id"]
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        extra = {"prefill": body["prefill"]} if self.role == "decode" and "prefill" in body else {}
        self.engine.submit(
            rid,
            prompt,
            params,
            lambda o: loop.call_soon_threadsafe(queue.put_nowait, o),
            float(timeout) if timeout else None,
            **extra,
        )
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        finished = False
        deadline = time.monotonic() + float(timeout or self.engine.cfg.request_timeout_s) + GRACE_S
        try:
            await resp.prepare(request)
            while not finished:
                try:
                    out = await asyncio.wait_for(
                        queue.get(), max(deadline - time.monotonic(), 0.001)
                    )
                except TimeoutError:
                    out = RequestOutput(
                        rid, (), (), "error", "worker timed out waiting for its engine"
                    )
                finished = out.finish_reason is not None
                await resp.write(json.dumps(output_to_json(out)).encode() + b"\n")
            await resp.write_eof()
        finally:
            if not finished:
                self.engine.abort(rid)
        return resp
