"""One API call's generation: fan out prompts x n choices to a backend, fan the outputs in.

The backend is anything with validate/submit/abort (the local engine here; a remote decode
worker behind the router). Outputs cross from the engine thread into asyncio through the
loop's `Handoff`, one wake-up per burst, and wait in one `OutputStream` per call; what piled
up while the caller was busy comes out merged, one delta per choice
(server/output_stream.py). Every wait is bounded by the call's deadline. A choice that is
still running when the caller stops listening (disconnect, error, stop string) is aborted by
`close()`, which the caller runs in a `finally` around the whole answer: a client gone before
the first output was read is aborted as surely as one gone mid-stream (LESSONS #17).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.frontend.textstream import Detokenizer, TextStream
from pdserve.protocol.outputs import RequestOutput, TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import STREAM_GRACE_S
from pdserve.server.output_stream import OutputStream, StreamTimeout, handoff, merge_runs


class Backend(Protocol):
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None: ...
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        timeout_s: float | None = None,
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ...
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Delta:
    """New text (and its tokens) for one choice; `finish_reason` set on its last delta."""

    choice: Choice
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None = None


class Generation:
    def __init__(
        self,
        backend: Backend,
        prompts: Sequence[list[int]],
        n: int,
        params: SamplingParams,
        make_detok: Callable[[], Detokenizer],
        stop: Sequence[str],
        include_stop: bool,
        timeout_s: float,
    ) -> None:
        self.backend = backend
        self.id = uuid.uuid4().hex
        self.params = params
        self.include_stop = include_stop
        self.timeout_s = timeout_s
        self.choices = [
            Choice(
                i * n + j,
                f"{self.id}-{i * n + j}",
                list(p),
                TextStream(make_detok(), stop, include_stop),
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        self._stream: OutputStream[tuple[int, RequestOutput]] | None = None
        self._closed = False
        self.aborted = 0  # choices close() aborted while they were still running

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        stream = self._stream = OutputStream(loop, loop.time() + self.timeout_s + STREAM_GRACE_S)
        push, put = handoff(loop).push, stream.put
        for c in self.choices:
            params = self.params
            if params.seed is not None and c.index:
                params = params.replace(seed=params.seed + c.index)

            def sink(out: RequestOutput, i: int = c.index) -> None:
                push(put, (i, out))

            self.backend.submit(c.request_id, c.prompt_ids, params, sink, self.timeout_s)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield text deltas until every choice has finished; aborts leftovers on exit."""
        async for batch in self.batches():
            for d in batch:
                yield d

    async def batches(self) -> AsyncIterator[list[Delta]]:
        """The deltas of whatever arrived since the last batch: at most one per choice and
        output run, so a stream that fell behind catches up in one chunk per choice. Until
        every choice has finished; aborts leftovers on exit."""
        stream = self._stream
        assert stream is not None, "start() first"
        try:
            while any(c.finish_reason is None for c in self.choices):
                try:
                    items = await stream.take()
                except StreamTimeout:
                    batch = []
                    for c in self.choices:
                        if c.finish_reason is None:
                            c.finish_reason, c.error = "error", "timed out waiting for the engine"
                            batch.append(Delta(c, c.text.finish(), (), (), "error"))
                    yield batch
                    return
                per_choice: dict[int, list[RequestOutput]] = {}
                for i, out in items:
                    per_choice.setdefault(i, []).append(out)
                batch = []
                for i, outs in per_choice.items():
                    for out in merge_runs(outs):
                        delta = self._apply(self.choices[i], out)
                        if delta is not None:
                            batch.append(delta)
                if batch:
                    yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Stop listening: abort every choice the backend may still be running (unfinished,
        or stopped here on a stop string). Idempotent; for any window of the call's life,
        before its first output as after (`aborted` counts the unfinished ones)."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream.close()
        for c in self.choices:
            if c.finish_reason is None or c.text.stopped:
                self.backend.abort(c.request_id)
                if c.finish_reason is None:
                    self.aborted += 1

    def _apply(self, c: Choice, out: RequestOutput) -> Delta | None:
        if c.finish_reason is not None:
            return None  # e.g. the engine's end after we stopped on a stop string
        shown = out.token_ids
        if out.finish_reason == "stop" and shown and not self.include_stop:
            shown = shown[:-1]  # the stop token (or EOS) itself, as vLLM: ids and logprobs keep it
        kept = len(out.token_ids)
        parts = []
        for k, t in enumerate(shown):
            parts.append(c.text.push(t))
            if c.text.stopped:  # a stop string: what an output carries past it was never shown
                kept = k + 1
                break
        text = "".join(parts)
        token_ids, logprobs = out.token_ids[:kept], out.logprobs[:kept]
        c.token_ids.extend(token_ids)
        c.logprobs.extend(logprobs)
        c.prompt_logprobs.extend(out.prompt_logprobs)
        if c.text.stopped:
            c.finish_reason = "stop"
        elif out.finish_reason is not None:
            text += c.text.finish()
            c.finish_reason, c.error = out.finish_reason, out.error
            if out.finish_reason == "abort":  # we never asked: the engine is shutting down
                c.finish_reason = "error"
                c.error = out.error or "the request was aborted by the server"
        if not text and not token_ids and c.finish_reason is None:
            return None
        return Delta(c, text, token_ids, logprobs, c.finish_reason)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)
