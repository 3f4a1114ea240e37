"""An ASGI middleware that asks for the API key on every route of an inference server.

vLLM's own `--api-key` check covers only paths under `/v1`, `/v2`, `/inference` and `/cohere`:
`/tokenize`, `/detokenize`, `/metrics` and the development-mode routes rollserve uses to load
weights (`/pause`, `/collective_rpc`, `/resume`, ...) stay open to anything that reaches the
port, loopback included. This class closes them all but the liveness probes (`/health`,
`/ping`), for the key in `VLLM_API_KEY`:

- the development server adds it when it has a key (`--api-key`, or `VLLM_API_KEY`);
- vLLM adds it with `--middleware rollserve_vllm_guard.GuardEveryRoute`
  (`deploy.engine.vllm_argv`; `deploy/vllm_plugins/rollserve_vllm_guard.py` is this file),
  and `VLLM_API_KEY` turns vLLM's own check on too. vLLM imports it from its own virtualenv,
  so it imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

OPEN_PATHS = frozenset({"/health", "/ping"})
"""Liveness probes, answered without the key (they say nothing but "up")."""

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class GuardEveryRoute:
    """Refuse (401) every HTTP or WebSocket request without `Authorization: Bearer <key>`
    but for `OPEN_PATHS`. The key is `api_key`, or `VLLM_API_KEY` without it; a server
    given an empty key refuses everything but those paths."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], api_key: str | None = None
    ) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "") if api_key is None else api_key
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def _allowed(self, scope: Scope) -> bool:
        if scope.get("method") == "OPTIONS" or scope.get("path", "") in OPEN_PATHS:
            return True
        if self._digest is None:
            return False
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.strip().encode()).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
