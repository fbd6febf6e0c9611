"""Ports: drawn below the kernel's ephemeral range, and a server whose port is taken
before it binds starts again on a fresh one."""

from __future__ import annotations

import socket

import pytest

from fnrl.shell import net


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low = net.ephemeral_low()
    ports = {net.free_port() for _ in range(20)}
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))      # free when drawn (nothing else took it since)
        if low - net.LOWEST >= 1024:
            assert net.LOWEST <= port < low
    assert len(ports) > 1                    # drawn at random, not one fixed port


def test_port_taken_reads_only_the_latest_start(tmp_path):
    log = tmp_path / "rollout0.log"
    log.write_bytes(b"start 1\nOSError: [Errno 98] Address already in use\n")
    since = log.stat().st_size
    assert net.port_taken(log) and not net.port_taken(log, since)
    with log.open("ab") as f:
        f.write(b"start 2\nKilled\n")
    assert not net.port_taken(log, since)
    assert not net.port_taken(tmp_path / "missing.log")


def squatted() -> socket.socket:
    """A socket listening on a loopback port: what took it after free_port chose it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.slow
def test_a_server_whose_port_was_taken_starts_again_on_a_fresh_one(tmp_path, tiny_model_dir,
                                                                   monkeypatch):
    """At the first start (Cluster.wait_servers_ready) and at a supervised restart
    (HttpRollout.restart), each with a real vLLM server."""
    import asyncio

    import aiohttp

    from fnrl.backends import roles
    from fnrl.backends.local import HttpRollout
    from fnrl.serving.server import ServerSpec

    log = tmp_path / "logs" / "rollout0.log"
    with squatted() as first, squatted() as second:
        cluster = roles.Cluster(tmp_path)
        try:
            taken = first.getsockname()[1]
            cluster.start_server(0, ServerSpec(model_dir=str(tiny_model_dir), port=taken,
                                               max_model_len=32, max_num_seqs=4))
            cluster.wait_servers_ready(timeout_s=300)
            assert not cluster.role("rollout0").address.endswith(f":{taken}")
            assert log.read_text().count("Address already in use") == 1   # one lost start

            # The restart's first port is taken too; its second is drawn as usual.
            draws = iter([second.getsockname()[1]])
            monkeypatch.setattr(roles, "free_port", lambda: next(draws, None) or net.free_port())

            async def restart() -> str:
                async with aiohttp.ClientSession() as session:
                    rollout = HttpRollout(cluster, 0, session, timeout_s=30, start_timeout_s=300)
                    await rollout.restart()
                    await rollout.metrics()             # the new client reaches the server
                    return cluster.role("rollout0").address
            address = asyncio.run(restart())
            assert not address.endswith(f":{second.getsockname()[1]}")
            assert log.read_text().count("Address already in use") == 2
        finally:
            cluster.stop()


def test_listens_on_names_the_process_that_holds_the_port():
    import os

    with squatted() as s:
        port = s.getsockname()[1]
        assert net.listens_on(os.getpid(), port) is True
        assert net.listens_on(os.getpid(), net.free_port()) is False
    assert net.listens_on(2**22 + 12345, port) is None   # no such process: cannot tell


FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_health_answer_from_another_server_on_the_port_is_not_taken_for_ready(
        tmp_path, monkeypatch):
    """The port a server was given is held by another HTTP server whose /health answers
    200 (a CI run's 401s came from one): `serve` does not take that answer for its own
    server's, sees its own exit on "Address already in use", and starts it again on a
    fresh port. (The server here is a stand-in launched through the same function.)"""
    import http.server
    import subprocess
    import sys
    import threading

    from fnrl.serving import server as srv
    from fnrl.shell import procs

    def launch(spec, log_path):
        return procs.spawn([sys.executable, "-c", FAKE_SERVER, str(spec.port)], log_path)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    monkeypatch.setattr(srv, "launch_server", launch)
    other = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    try:
        given = srv.ServerSpec(model_dir=str(tmp_path), port=taken, max_model_len=32,
                               max_num_seqs=1)
        spec, proc = srv.serve(given, tmp_path / "log", timeout_s=60)
        try:
            assert spec.port != taken and net.listens_on(proc.pid, spec.port)
            assert (tmp_path / "log").read_text().count("Address already in use") == 1
        finally:
            srv.stop_server(proc)
        assert isinstance(proc, subprocess.Popen) and proc.poll() is not None
    finally:
        other.shutdown()
        other.server_close()
