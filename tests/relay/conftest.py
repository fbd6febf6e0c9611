"""Fixtures that start real relay processes and always clean up after them."""

from __future__ import annotations

import dataclasses
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from fnrl.relay import store
from fnrl.relay.launch import launch_relay, stop_relay, wait_relay_ready
from fnrl.shell.net import free_port
from fnrl.relay.role import segment_prefix


@dataclasses.dataclass(frozen=True)
class RelayProcess:
    address: str
    name: str
    proc: subprocess.Popen
    log_path: Path

    def wait_for_log(self, text: str, timeout_s: float = 60.0) -> None:
        """Wait until the relay's log contains `text` (a condition, not a fixed window)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"{self.name} never logged {text!r}"
            time.sleep(0.05)

    def segments(self) -> list[str]:
        """This relay's segment files in /dev/shm, sorted by version."""
        paths = store.SHM_DIR.glob(f"{segment_prefix(self.name)}{self.proc.pid}-v*")
        return sorted((p.name for p in paths), key=lambda s: int(s.rsplit("-v", 1)[1]))


def start_relay(log_dir: Path, name: str | None = None) -> RelayProcess:
    name = name or f"t{uuid.uuid4().hex[:10]}"
    address = f"tcp://127.0.0.1:{free_port()}"
    log_path = log_dir / f"relay-{name}.log"
    proc = launch_relay(address, name, log_path)
    try:
        wait_relay_ready(address, proc)
    except BaseException:
        stop_relay(proc, name)
        raise
    return RelayProcess(address, name, proc, log_path)


@pytest.fixture
def relay_factory(tmp_path):
    """Call it to start a relay (optionally with a given name); all are stopped after."""
    started: list[RelayProcess] = []

    def start(name: str | None = None) -> RelayProcess:
        relay = start_relay(tmp_path, name)
        started.append(relay)
        return relay

    yield start
    for relay in started:
        stop_relay(relay.proc, relay.name)
        for path in store.SHM_DIR.glob(f"{segment_prefix(relay.name)}*"):
            store.unlink_segment(path.name)


@pytest.fixture
def relay(relay_factory) -> RelayProcess:
    return relay_factory()


@pytest.fixture
def tier_factory(tmp_path):
    """Call it with a RelayConfig to start a chained tier of relays; all stopped after."""
    from fnrl.relay.tier import RelayTier

    started: list[RelayTier] = []

    def start(cfg) -> RelayTier:
        tier = RelayTier.launch(cfg, tmp_path, prefix=f"t{uuid.uuid4().hex[:8]}r")
        started.append(tier)
        return tier

    yield start
    for tier in started:
        tier.stop()
        for name in tier.members:
            for path in store.SHM_DIR.glob(f"{segment_prefix(name)}*"):
                store.unlink_segment(path.name)
