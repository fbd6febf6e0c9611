"""A request whose pooled socket the server closed as it was sent is sent once more."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from fnrl.serving.client import RolloutClient, ServerError


async def _server(close_first: int):
    """A raw HTTP server on loopback that drops its first `close_first` connections
    without answering (what a server closing a keep-alive socket looks like), then
    answers every request with a JSON body; returns (server, url, requests seen)."""
    seen = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b"\r\n", 1)[0].decode())
        if len(seen) <= close_first:
            writer.close()
            return
        length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                           if ln.lower().startswith(b"content-length")), b"0"))
        await reader.readexactly(length)
        body = json.dumps({"ok": True}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


@pytest.mark.parametrize("dropped, answered", [(1, True), (2, False)])
def test_a_dropped_connection_is_retried_once(dropped, answered):
    async def run():
        server, url, seen = await _server(dropped)
        try:
            async with aiohttp.ClientSession() as session:
                client = RolloutClient(url, session)
                if answered:
                    assert await client._post("/v1/completions", {"x": 1}, 10.0) == {"ok": True}
                else:
                    with pytest.raises(ServerError, match="ServerDisconnectedError"):
                        await client._post("/v1/completions", {"x": 1}, 10.0)
        finally:
            server.close()
            await server.wait_closed()
        return seen

    seen = asyncio.run(run())
    assert seen == ["POST /v1/completions HTTP/1.1"] * 2
