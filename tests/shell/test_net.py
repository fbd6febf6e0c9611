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


@pytest.mark.slow
def test_a_server_whose_port_was_taken_starts_again_on_a_fresh_one(tmp_path, tiny_model_dir):
    from fnrl.control.roles import Cluster
    from fnrl.serving.server import ServerSpec

    with socket.socket() as squatter:          # what took the port after free_port chose it
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        cluster = Cluster(tmp_path)
        try:
            cluster.start_server(0, ServerSpec(model_dir=str(tiny_model_dir), port=taken,
                                               max_model_len=32, max_num_seqs=4))
            cluster.wait_servers_ready(timeout_s=300)
            address = cluster.role("rollout0").address
            assert not address.endswith(f":{taken}")
            log = (tmp_path / "logs" / "rollout0.log").read_text()
            assert log.count("Address already in use") == 1   # one lost start, then ready
        finally:
            cluster.stop()
