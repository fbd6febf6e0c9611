"""The controller <-> role message format, and a RoleClient that notices a dead peer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import zmq

from fnrl.shell import wire
from fnrl.shell.net import free_port


def test_arrays_round_trip_without_changing_dtype_or_shape():
    ctx = zmq.Context.instance()
    address = f"tcp://127.0.0.1:{free_port()}"
    server, client = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    try:
        server.bind(address)
        client.connect(address)
        arrays = {"tokens_BxT": np.arange(6, dtype=np.int32).reshape(2, 3),
                  "adv_B": np.array([0.5, -1.5], np.float32)}
        nonce = wire.send(client, {"op": "train"}, arrays)
        header, got = wire.recv(server, timeout_s=5, role="trainer")
        assert header == {"op": "train", "_nonce": nonce}
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and np.array_equal(got[name], a)
        wire.send(server, {"error": "Traceback: boom"}, reply_to=nonce)
        with pytest.raises(wire.RoleError, match="trainer failed:\nTraceback: boom"):
            wire.recv(client, timeout_s=5, role="trainer", reply_to=nonce)
    finally:
        server.close()
        client.close()


def test_role_client_reports_a_dead_peer_with_its_log(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text("Traceback\nMemoryError\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    client = wire.RoleClient("trainer", f"tcp://127.0.0.1:{free_port()}", proc, str(log))
    try:
        with pytest.raises(wire.RoleError, match="(?s)trainer exited with code 3.*MemoryError"):
            client.call({"op": "ping"}, timeout_s=5)
    finally:
        client.close()
