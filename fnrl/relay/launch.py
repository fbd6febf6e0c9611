"""Start and stop relay role processes (used by the controller and by tests)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from fnrl.config import RelayConfig
from fnrl.relay import store
from fnrl.relay.client import RelayClient, RelayError
from fnrl.relay.role import segment_prefix
from fnrl.shell import procs


def relay_argv(address: str, name: str, cfg: RelayConfig | None = None, *,
               parent_pid: int = 0) -> list[str]:
    """The command line of one relay role process (`parent_pid`: `RelayArgs.parent_pid`)."""
    argv = [sys.executable, "-m", "fnrl.relay.role", "--address", address, "--name", name,
            "--parent-pid", str(parent_pid)]
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
    """Start `python -m fnrl.relay.role`; stdout and stderr go to `log_path`.

    It stays in its parent's session and is not tied to the spawning thread's life:
    the tier starts relays from short-lived threads, and `stop_relay` (or the job's
    `Cluster`) ends them. If this process dies without doing so (SIGKILL, or a SIGTERM
    it does not handle), the relay notices within 0.1 s and stops, unlinking its
    segments (`RelayArgs.parent_pid`)."""
    fnrl_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (fnrl_root, env.get("PYTHONPATH")) if p)
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return procs.spawn(relay_argv(address, name, cfg, parent_pid=os.getpid()), log_path,
                       env=env, own_session=False, with_parent=False)


def wait_relay_ready(address: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> dict:
    """Ping until the relay answers; returns its ping reply. Raises if it dies or stalls."""
    deadline = time.monotonic() + timeout_s
    with RelayClient(address, timeout_s=0.5) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"relay {address} {procs.exit_reason(proc)}")
            try:
                return client.ping()
            except RelayError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"relay {address} not ready after {timeout_s:g} s")


def stop_relay(proc: subprocess.Popen, name: str, timeout_s: float = 10.0) -> None:
    """SIGTERM (the relay unlinks its segments), SIGKILL if it lingers, then remove
    whatever segments this process left behind."""
    procs.stop(proc, timeout_s, group=False)
    remove_segments(name, proc.pid)


def remove_segments(name: str, pid: int) -> int:
    """Unlinks the shared-memory segments relay `name` (process `pid`) left behind;
    returns how many. A relay killed before its clean-up (SIGKILL) leaves them."""
    paths = list(store.SHM_DIR.glob(f"{segment_prefix(name)}{pid}-*"))
    for path in paths:
        store.unlink_segment(path.name)
    return len(paths)
