"""vLLM servers and the run's API key: loopback servers start as before; a server bound
beyond loopback (or asked to) gets the key in its environment and refuses every request
without it, dev endpoints included; the rollout client sends it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from fnrl.serving import http_auth
from fnrl.serving.client import RolloutClient, ServerError
from fnrl.serving.server import (API_KEY_MIDDLEWARE, ServerSpec, launch_server,
                                 server_command, server_env, stop_server, wait_ready)
from fnrl.shell import auth
from fnrl.shell.net import free_port


def spec(model_dir, **kw) -> ServerSpec:
    """A server's spec (an explicit KV fraction: no model is read to size the KV)."""
    return ServerSpec(model_dir=str(model_dir), port=free_port(), max_model_len=256,
                      max_num_seqs=4, **{"kv_memory_fraction": 0.1, **kw})


def test_only_a_server_beyond_loopback_or_asked_to_requires_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-the-shell")
    local = spec(tmp_path)
    assert not local.requires_api_key and API_KEY_MIDDLEWARE not in server_command(local)
    assert "VLLM_API_KEY" not in server_env(local)   # an inherited key would lock us out
    for guarded in (spec(tmp_path, host="0.0.0.0"), spec(tmp_path, host="10.1.2.3"),
                    spec(tmp_path, require_api_key=True)):
        argv, env = server_command(guarded), server_env(guarded)
        assert guarded.requires_api_key and API_KEY_MIDDLEWARE in argv
        assert env["VLLM_API_KEY"] == auth.api_key()
        # Neither the key nor the secret is on the command line (vLLM logs its arguments).
        assert not any(auth.api_key() in a or auth.process_auth().secret.hex() in a
                       for a in argv)
    assert spec(tmp_path, host="::1").base_url.startswith("http://[::1]:")
    with pytest.raises(ValueError, match="host='bad host'"):
        spec(tmp_path, host="bad host")


def asgi_status(app, path: str, authorization: str | None) -> int:
    """The status `app` answers a GET of `path` with."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    asyncio.run(app({"type": "http", "method": "GET", "path": path, "headers": headers},
                    receive, send))
    return sent[0]["status"]


def test_the_middleware_guards_every_path_but_health(monkeypatch):
    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):   # fails closed
        http_auth.RequireApiKey(inner)
    monkeypatch.setenv("VLLM_API_KEY", "k" * 64)
    app = http_auth.RequireApiKey(inner)
    for path in ("/v1/completions", "/collective_rpc", "/pause", "/metrics",
                 "/reset_prefix_cache"):
        assert asgi_status(app, path, None) == 401
        assert asgi_status(app, path, "Bearer wrong") == 401
        assert asgi_status(app, path, "Basic " + "k" * 64) == 401
        assert asgi_status(app, path, "Bearer " + "k" * 64) == 200
    assert asgi_status(app, "/health", None) == 200


@pytest.mark.slow
def test_a_real_server_refuses_requests_without_the_key(tiny_model_dir, tmp_path):
    # On loopback (tests stay there), asked to require the key; KV sized from the need.
    guarded = spec(tiny_model_dir, require_api_key=True, kv_memory_fraction=0.0)
    proc = launch_server(guarded, tmp_path / "vllm.log")

    async def check():
        async with aiohttp.ClientSession() as session:
            for method, path in (("GET", "/v1/models"), ("POST", "/collective_rpc"),
                                 ("GET", "/metrics"), ("POST", "/reset_prefix_cache")):
                async with session.request(method, guarded.base_url + path,
                                           json={"method": "fnrl_version"}) as response:
                    assert response.status == 401, path
            wrong = RolloutClient(guarded.base_url, session, api_key="0" * 64)
            with pytest.raises(ServerError, match="401"):
                await wrong.version()
            client = RolloutClient(guarded.base_url, session)   # the run's key
            assert await client.version() == -1
            out = await client.generate([1, 2, 3], n=1, max_tokens=4, temperature=0.0, seed=0)
            assert 1 <= len(out[0].token_ids) <= 4

    try:
        wait_ready(guarded.base_url, proc, timeout_s=300)   # /health needs no key
        asyncio.run(check())
        log = (tmp_path / "vllm.log").read_text()
        assert auth.api_key() not in log and auth.process_auth().secret.hex() not in log
    finally:
        stop_server(proc)
