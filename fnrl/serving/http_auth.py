"""An ASGI middleware that asks every request to a vLLM server for its API key.

vLLM's own `--api-key` / `VLLM_API_KEY` guards only the /v1, /v2, /inference and
/cohere paths (vllm/entrypoints/serve/middleware/authenticate.py, vLLM 0.32), not the
dev endpoints fnrl turns on (/collective_rpc: any worker method by name, /pause,
/reset_prefix_cache) nor /metrics. A server bound to an interface other than loopback
is started with this class (`--middleware`, fnrl.serving.server) and the key in
`VLLM_API_KEY` (its environment: never a command line, which vLLM logs): every path but
/health (the readiness probe, which tells nothing but "up") then needs
`Authorization: Bearer <key>`, or gets 401.
"""

from __future__ import annotations

import hashlib
import hmac
import os

OPEN_PATHS = ("/health",)


class RequireApiKey:
    """Pure ASGI: answers 401 to any HTTP or websocket request without the key."""

    def __init__(self, app):
        key = os.environ.get("VLLM_API_KEY")
        if not key:   # fail closed: a server meant to be guarded must not start open
            raise RuntimeError("RequireApiKey: VLLM_API_KEY is not set")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                # Digests compared in constant time: the key's length leaks nothing.
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS \
                or self._allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": "Unauthorized"}'})
