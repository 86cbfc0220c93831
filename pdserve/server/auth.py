"""Who may call which HTTP endpoint: the API key for clients, the cluster key for the cluster.

Three kinds of endpoint, on the router, a co-located server and the workers alike:
* the client API (`/v1/...`, and vLLM's `/tokenize`, `/detokenize`, `/version`): clients.
  With `--api-key` (or `--api-key-file`, $PDSERVE_API_KEY) every call needs
  `Authorization: Bearer <api key>`, as in vLLM and SGLang;
* liveness and metrics (`/health`, `/health/deep`, `/ping`, `/metrics`): open, so that load
  balancers and Prometheus need no secret, unless `--protect-health` closes them too;
* everything else (a worker's `/generate`, `/abort`, `/info`; `/debug/*` everywhere): the
  cluster and its operator. They take the cluster key's bearer token (runtime/cluster_key.py)
  or the API key. `/debug/*` shows live request ids, so nobody without a key reads them
  where a key is configured.
A path no route serves is answered as a client API path: 404 (OpenAI-style, by the error
middleware) where no API key is configured, whatever the cluster key; where one is, 401
without it, so a caller without the key learns nothing, not even which paths exist.
With no key of either kind configured, everything is open: such a server should listen on
loopback only (docs/security.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.runtime.cluster_key import ClusterKey, bearer_matches
from pdserve.server.api_error import ApiError

API_KEY_ENV = "PDSERVE_API_KEY"
HEALTH_PATHS = frozenset({"/health", "/health/deep", "/ping", "/metrics"})
CLIENT_PATHS = frozenset({"/tokenize", "/detokenize", "/version"})  # besides /v1/...


def load_api_key(key: str | None, key_file: str | None) -> str | None:
    """--api-key, else --api-key-file's first line, else $PDSERVE_API_KEY, else None."""
    if key is None and key_file is not None:
        key = Path(key_file).read_text().strip()
    key = key if key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and len(key) < 8:
        raise ValueError("an API key needs at least 8 characters")
    return key or None


@dataclass(frozen=True)
class Gate:
    api_key: str | None = None
    cluster_key: ClusterKey | None = None
    protect_health: bool = False  # /health and /metrics need a key too

    def refusal(self, path: str, authorization: str | None, routed: bool = True) -> ApiError | None:
        """None if a call to `path` with this Authorization header may go on; `routed`:
        whether a route serves the path (one that none serves is a client path: its 404 is
        answered only to whoever may call the client API)."""
        if path in HEALTH_PATHS and not self.protect_health:
            return None
        api_ok = self.api_key is not None and bearer_matches(authorization, self.api_key)
        if path.startswith("/v1/") or path in CLIENT_PATHS or not routed:
            if self.api_key is None or api_ok:
                return None
            return ApiError(
                401,
                "a valid API key is needed (Authorization: Bearer <key>)",
                type_="authentication_error",
                code="invalid_api_key",
            )
        keys = [k for k in (self.api_key, self.cluster_key) if k is not None]
        cluster_ok = self.cluster_key is not None and self.cluster_key.http_ok(authorization)
        if not keys or api_ok or cluster_ok:
            return None
        return ApiError(
            401,
            "this endpoint needs the cluster key or the API key (Authorization: Bearer ...)",
            type_="authentication_error",
            code="key_required",
        )

    def middleware(self) -> Middleware:
        @web.middleware
        async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
            routed = not isinstance(request.match_info.http_exception, web.HTTPNotFound)
            refused = self.refusal(request.path, request.headers.get("Authorization"), routed)
            if refused is None:
                return await handler(request)
            return web.json_response(
                refused.body(), status=refused.status, headers={"WWW-Authenticate": "Bearer"}
            )

        return authenticate
