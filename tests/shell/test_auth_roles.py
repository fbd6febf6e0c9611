"""Real role processes and the run's secret: a relay refuses (and logs) control messages
without it or with another run's, over ZeroMQ and over its UCX handshake, and serves on;
a role started without a secret does not start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.shell.raw_zmq import raw_call

from fnrl.config import RelayConfig
from fnrl.relay import store
from fnrl.relay.client import RelayClient, RelayError
from fnrl.relay.launch import launch_relay, stop_relay, wait_relay_ready
from fnrl.relay.role import segment_prefix
from fnrl.shell import auth
from fnrl.shell.net import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def relays(tmp_path):
    """Call it to start a relay (with `secret`, else this process's); all stopped after."""
    started = []

    def start(secret: bytes | None = None, cfg: RelayConfig | None = None):
        name = f"t{uuid.uuid4().hex[:10]}"
        address = f"tcp://127.0.0.1:{free_port()}"
        saved = os.environ.get(auth.ENV_VAR)
        if secret is not None:   # spawned roles inherit the environment's secret
            os.environ[auth.ENV_VAR] = secret.hex()
        try:
            proc = launch_relay(address, name, tmp_path / f"{name}.log", cfg)
        finally:
            if saved is not None:
                os.environ[auth.ENV_VAR] = saved
        started.append((proc, name))
        return name, address, proc, tmp_path / f"{name}.log"

    auth.process_auth()   # this process's secret, before any relay starts
    yield start
    for proc, name in started:
        stop_relay(proc, name)
        for path in store.SHM_DIR.glob(f"{segment_prefix(name)}*"):
            store.unlink_segment(path.name)


def wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_relay_refuses_and_logs_messages_without_the_runs_secret_and_serves_on(relays):
    name, address, proc, log = relays()
    wait_relay_ready(address, proc)
    good, _ = auth.process_auth().seal({"op": "ping"})
    other_run = auth.Authenticator(auth.new_secret()).seal({"op": "ping"})[0]
    forged = {"no tag": [b'{"op": "ping"}'], "bad tag": other_run,
              "bad tag (another": [good[0], good[1].replace(b"ping", b"latest")]}
    for reason, frames in forged.items():
        assert reason in auth.refusal_reason(raw_call(address, frames))
    with RelayClient(address, timeout_s=10) as client:   # a client without the secret
        saved = os.environ[auth.ENV_VAR]
        os.environ[auth.ENV_VAR] = auth.new_secret().hex()
        try:
            with pytest.raises(RelayError, match="refused 'ping': bad tag"):
                client.ping()
        finally:
            os.environ[auth.ENV_VAR] = saved
        assert client.ping()["name"] == name                  # still serving
    refused = [line for line in log.read_text().splitlines() if "refused a control" in line]
    assert len(refused) == 4, refused
    assert all(f"from 127.0.0.1 on relay {name} {address}" in line for line in refused)
    assert auth.process_auth().secret.hex() not in log.read_text()
    assert proc.poll() is None


def test_a_relay_of_another_run_refuses_the_chain_handshake(relays):
    cfg = RelayConfig(chunk_timeout_s=2.0)
    up_name, up, up_proc, up_log = relays(cfg=cfg)
    other = auth.new_secret()
    down_name, down, down_proc, down_log = relays(other, cfg)
    wait_relay_ready(up, up_proc)
    saved = os.environ[auth.ENV_VAR]
    os.environ[auth.ENV_VAR] = other.hex()   # the other run's controller places its relay
    try:
        down_ping = wait_relay_ready(down, down_proc)
    finally:
        os.environ[auth.ENV_VAR] = saved
    with RelayClient(up, timeout_s=10) as client:
        client.set_chain(epoch=0, master=up_name, master_address=up,
                         downstream={"name": down_name, "ucx_address": down_ping["ucx_address"]})
        client.publish(1, {"w": np.arange(1000, dtype=np.float32)})
    wait_for(lambda: f"on relay {down_name} UCX: bad tag" in down_log.read_text(),
             "the downstream never refused the header")
    wait_for(lambda: "forwarding version 1" in up_log.read_text(),
             "the upstream never gave up on the refused stream")
    os.environ[auth.ENV_VAR] = other.hex()
    try:
        with RelayClient(down, timeout_s=10) as client:
            assert client.ping()["version"] is None           # it took nothing
    finally:
        os.environ[auth.ENV_VAR] = saved


def test_a_role_started_without_a_secret_does_not_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run([sys.executable, "-m", "fnrl.relay.role", "--address",
                             f"tcp://127.0.0.1:{free_port()}", "--name", "nosecret"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "FNRL_RUN_SECRET is not set" in result.stdout + result.stderr


def test_the_trainer_role_refuses_forged_commands_and_trains_on(tmp_path, tiny_model_dir,
                                                              write_run_config):
    from fnrl.backends.roles import Cluster
    from fnrl.shell.wire import RoleClient

    run_dir = tmp_path / "run"
    cfg_path = write_run_config(run_dir, run_dir=str(run_dir))
    cluster = Cluster(run_dir)   # a fresh secret for this attempt
    try:
        relay = cluster.start_relay("relay0")
        cluster.wait_relay_ready(relay)
        role = cluster.start_trainer(cfg_path, tiny_model_dir, relay.address)
        secret = os.environ[auth.ENV_VAR]
        assert secret not in " ".join(role.proc.args)               # not on its command line
        assert f"{auth.ENV_VAR}={secret}".encode() in Path(f"/proc/{role.proc.pid}/environ").read_bytes()
        shutdown = auth.process_auth().seal({"cmd": "shutdown", "_arrays": []})[0]
        forged = {"no tag": [b'{"cmd": "shutdown", "_arrays": []}'],
                  "bad tag": auth.Authenticator(auth.new_secret()).seal({"cmd": "shutdown"})[0],
                  "bad tag (another": [shutdown[0], shutdown[1].replace(b"shutdown", b"init")]}
        for reason, frames in forged.items():
            assert reason in auth.refusal_reason(raw_call(role.address, frames))
        client = RoleClient("trainer", role.address, role.proc, str(role.log_path))
        assert client.call({"cmd": "init"}, timeout_s=300)["version"] == 0   # serving on
        client.call({"cmd": "shutdown"}, timeout_s=60)
        client.close()
        role.proc.wait(60)
        log = role.log_path.read_text()
        assert log.count(f"from 127.0.0.1 on trainer {role.address}") == 3, log[-3000:]
        for path in (run_dir / "config.json", run_dir / "roles.json", role.log_path):
            assert secret not in path.read_text()
    finally:
        cluster.stop()
