"""No process or shared-memory segment outlives a job: a controller SIGKILLed while its
relays hold weights (the kernel tells its roles; a relay unlinks its segments), and a
re-run controller's clean-up of what a stopped relay left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from fnrl.config import RelayConfig
from fnrl.control.roles import Cluster, read_roles
from fnrl.relay import store
from fnrl.relay.client import RelayClient
from fnrl.shell.procs import alive

pytestmark = pytest.mark.slow

CONTROLLER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from fnrl.config import RelayConfig
    from fnrl.control.roles import Cluster
    from fnrl.relay.client import RelayClient
    cluster = Cluster(Path(sys.argv[1]))
    tier = cluster.start_relays(RelayConfig(num_relays=2))
    with RelayClient(tier.addresses[0], timeout_s=30) as client:
        client.publish(1, {"w": np.arange(1 << 16, dtype=np.float32)})
        tier_holds = [RelayClient(a, timeout_s=30) for a in tier.addresses]
        for c in tier_holds:
            c.wait_version(1, timeout_s=60)
    print("ready", flush=True)
    time.sleep(3600)
""")


def segments(names_pids) -> list[str]:
    return [p.name for name, pid in names_pids
            for p in store.SHM_DIR.glob(f"fnrl-relay-{name}-{pid}-*")]


def wait_until(cond, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_sigkilled_controller_leaves_no_relay_or_segment(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        relays = [(n, int(i["pid"])) for n, i in read_roles(tmp_path / "roles.json").items()]
        assert len(relays) == 2 and segments(relays)          # weights are in shared memory
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until(lambda: not any(alive(pid) for _, pid in relays))
        assert segments(relays) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_rerun_controller_removes_what_a_stopped_relay_left(tmp_path):
    cluster = Cluster(tmp_path)
    tier = cluster.start_relays(RelayConfig(num_relays=1))
    relay = cluster.role("relay0")
    try:
        with RelayClient(tier.addresses[0], timeout_s=30) as client:
            client.publish(1, {"w": np.arange(1 << 16, dtype=np.float32)})
        tier.stop_monitor()
        os.kill(relay.proc.pid, signal.SIGSTOP)
        os.kill(relay.proc.pid, signal.SIGKILL)               # no chance to clean up
        relay.proc.wait()
        left = segments([("relay0", relay.proc.pid)])
        assert left
        Cluster(tmp_path)                                      # the re-run's start-up
        assert segments([("relay0", relay.proc.pid)]) == []
    finally:
        cluster.stop()
