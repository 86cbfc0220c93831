"""Admission: at most `--max-queue` generation calls in flight per front end; past it, 429.

A client that opens requests faster than the engine finishes them would otherwise grow every
queue (the HTTP server's tasks, the engine inbox, the scheduler's waiting list) without
bound. The front end (a co-located server or the router) counts its `/v1/completions` and
`/v1/chat/completions` calls from arrival to the end of their answer; a call that would
exceed the limit is answered at once with 429 and `Retry-After`, the way OpenAI and vLLM
signal "slow down", and touches nothing else. Liveness, metrics and debug calls are never
counted or refused; the router's deep-health canary is a generation, so it takes slots
like one (`reserve`/`release`) and is not run when there are none (router/health.py).
Once the server is stopping (`draining`), a new generation call is answered 503 at once:
running ones may finish, new ones go elsewhere.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.runtime.timing import RETRY_AFTER_S
from pdserve.server.api_error import ApiError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Admission:
    def __init__(self, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.in_flight = 0
        self.refused = 0  # calls answered 429 since start (for /metrics and tests)
        self.draining = False  # set when the server begins to stop

    def reserve(self, n: int = 1) -> bool:
        """Take `n` slots for generations this process starts itself; False (nothing taken)
        if they do not fit under the bound or the server is stopping."""
        if self.draining or self.in_flight + n > self.max_queue:
            return False
        self.in_flight += n  # one event loop: no lock needed
        return True

    def release(self, n: int = 1) -> None:
        if n > self.in_flight:
            raise RuntimeError(f"release of {n} slots with {self.in_flight} taken: a bug")
        self.in_flight -= n

    def middleware(self) -> Middleware:
        @web.middleware
        async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path not in GENERATION_PATHS or request.method != "POST":
                return await handler(request)
            if self.draining:
                e = ApiError(
                    503,
                    "the server is shutting down; send the request to another one",
                    type_="server_error",
                    code="shutting_down",
                )
                return web.json_response(e.body(), status=503, headers={"Connection": "close"})
            if self.in_flight >= self.max_queue:
                self.refused += 1
                e = ApiError(
                    429,
                    f"the server has {self.in_flight} requests in flight (--max-queue "
                    f"{self.max_queue}); retry after {RETRY_AFTER_S}s",
                    type_="rate_limit_error",
                    code="queue_full",
                )
                return web.json_response(
                    e.body(), status=429, headers={"Retry-After": str(RETRY_AFTER_S)}
                )
            self.in_flight += 1  # one event loop: no lock needed
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1

        return admit
