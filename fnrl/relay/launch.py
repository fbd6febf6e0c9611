"""Start and stop relay role processes (used by the controller and by tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dataclasses

from fnrl.relay import store
from fnrl.relay.client import RelayClient, RelayError
from fnrl.relay.config import RelayConfig
from fnrl.relay.role import segment_prefix


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def relay_argv(address: str, name: str, cfg: RelayConfig | None = None) -> list[str]:
    """The command line of one relay role process."""
    argv = [sys.executable, "-m", "fnrl.relay.role", "--address", address, "--name", name]
    for field in dataclasses.fields(RelayConfig):
        value = getattr(cfg or RelayConfig(), field.name)
        flag = "--cfg." + field.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--cfg.", "--cfg.no-"))
        else:
            argv += [flag, str(value)]
    return argv


def launch_relay(address: str, name: str, log_path: str | os.PathLike,
                 cfg: RelayConfig | None = None) -> subprocess.Popen:
    """Start `python -m fnrl.relay.role`; stdout and stderr go to `log_path`."""
    fnrl_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (fnrl_root, env.get("PYTHONPATH")) if p)
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            relay_argv(address, name, cfg),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def wait_relay_ready(address: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> dict:
    """Ping until the relay answers; returns its ping reply. Raises if it dies or stalls."""
    deadline = time.monotonic() + timeout_s
    with RelayClient(address, timeout_s=0.5) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"relay {address} exited with code {proc.returncode}")
            try:
                return client.ping()
            except RelayError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"relay {address} not ready after {timeout_s:g} s")


def stop_relay(proc: subprocess.Popen, name: str, timeout_s: float = 10.0) -> None:
    """SIGTERM (the relay unlinks its segments), SIGKILL if it lingers, then remove
    whatever segments this process left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    for path in store.SHM_DIR.glob(f"{segment_prefix(name)}{proc.pid}-*"):
        store.unlink_segment(path.name)
