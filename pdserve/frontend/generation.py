"""One API call's generation: fan out prompts x n choices to a backend, fan the outputs in.

The backend is anything with validate/submit/abort (the local engine here; a remote decode
worker behind the router later). Outputs cross from the engine thread into asyncio through
`call_soon_threadsafe`. Every wait is bounded by the call's deadline, and a choice that is
still running when the caller stops listening (disconnect, error, stop string) is aborted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.frontend.textstream import Detokenizer, TextStream
from pdserve.protocol.outputs import RequestOutput, TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.timing import STREAM_GRACE_S


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
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for c in self.choices:
            params = self.params
            if params.seed is not None and c.index:
                params = params.replace(seed=params.seed + c.index)

            def sink(out: RequestOutput, i: int = c.index) -> None:
                loop.call_soon_threadsafe(self._queue.put_nowait, (i, out))

            self.backend.submit(c.request_id, c.prompt_ids, params, sink, self.timeout_s)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield text deltas until every choice has finished; aborts leftovers on exit."""
        deadline = time.monotonic() + self.timeout_s + STREAM_GRACE_S
        try:
            while any(c.finish_reason is None for c in self.choices):
                remaining = deadline - time.monotonic()
                try:
                    i, out = await asyncio.wait_for(self._queue.get(), max(remaining, 0.001))
                except TimeoutError:
                    for c in self.choices:
                        if c.finish_reason is None:
                            c.finish_reason, c.error = "error", "timed out waiting for the engine"
                            yield Delta(c, c.text.finish(), (), (), "error")
                    return
                delta = self._apply(self.choices[i], out)
                if delta is not None:
                    yield delta
        finally:
            for c in self.choices:
                if c.finish_reason is None or c.text.stopped:
                    self.backend.abort(c.request_id)

    def _apply(self, c: Choice, out: RequestOutput) -> Delta | None:
        if c.finish_reason is not None:
            return None  # e.g. the engine's end after we stopped on a stop string
        shown = out.token_ids
        if out.finish_reason == "stop" and shown and not self.include_stop:
            shown = shown[:-1]  # the stop token (or EOS) itself, as vLLM: ids and logprobs keep it
        text = "".join(c.text.push(t) for t in shown)
        c.token_ids.extend(out.token_ids)
        c.logprobs.extend(out.logprobs)
        c.prompt_logprobs.extend(out.prompt_logprobs)
        if c.text.stopped:
            c.finish_reason = "stop"
        elif out.finish_reason is not None:
            text += c.text.finish()
            c.finish_reason, c.error = out.finish_reason, out.error
            if out.finish_reason == "abort":  # we never asked: the engine is shutting down
                c.finish_reason = "error"
                c.error = out.error or "the request was aborted by the server"
        if not text and not out.token_ids and c.finish_reason is None:
            return None
        return Delta(c, text, out.token_ids, out.logprobs, c.finish_reason)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)
