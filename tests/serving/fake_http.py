"""An in-process HTTP server for the client's unit tests (fakes of vLLM's endpoints)."""

from __future__ import annotations

import contextlib

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(*routes: web.RouteDef):
    """Serves `routes` (aiohttp route definitions) on a free loopback port; yields its URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
