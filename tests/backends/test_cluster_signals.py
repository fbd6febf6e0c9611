"""A stop signal stops every role from the handler, before anything unwinds, and a
repeated one cannot cut that stop short (the slow runs of the main job are in
test_cluster_lifetime.py)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from fnrl.backends.roles import Cluster, RoleProcess, Stopped
from fnrl.shell import procs


def _sleeper(cluster: Cluster, name: str) -> RoleProcess:
    log = cluster.run_dir / "logs" / f"{name}.log"
    proc = procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"], log)
    return cluster._add(RoleProcess(name, proc, log, ""))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_stops_the_roles_then_raises_stopped(tmp_path, sig):
    cluster = Cluster(tmp_path)
    role = _sleeper(cluster, "worker")
    # As at a terminal: a background test run starts with SIGINT ignored, which the
    # cluster rightly leaves ignored (test_a_signal_ignored_before_stays_ignored).
    outer = signal.signal(sig, signal.SIG_DFL)
    before = signal.getsignal(sig)
    restore = cluster.stop_on_signals()
    try:
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), sig)
        assert stopped.value.signum == sig
        assert role.proc.poll() is not None   # stopped before anything unwound
        assert "was killed by fnrl with SIGTERM" in procs.exit_reason(role.proc)
        os.kill(os.getpid(), sig)             # while (after) stopping: ignored
    finally:
        with pytest.raises(Stopped):          # said again as the handlers go back
            restore()
        cluster.stop()
    assert signal.getsignal(sig) is before
    signal.signal(sig, outer)


def test_a_signal_ignored_before_stays_ignored(tmp_path):
    cluster = Cluster(tmp_path)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)     # as under nohup
    try:
        restore = cluster.stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        restore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)
        cluster.stop()


def test_a_stop_whose_exception_is_swallowed_is_still_known(tmp_path):
    """A signal that lands in a weakref callback has its Stopped swallowed there (seen
    in the lifetime e2e: the job took its stopped roles for failures and restarted). The
    cluster keeps the signal, and putting the handlers back raises Stopped from it (the
    job does that once its attempt ends: fnrl.experiments.math_grpo._run_once)."""
    import weakref

    cluster = Cluster(tmp_path)
    role = _sleeper(cluster, "worker")
    outer = signal.signal(signal.SIGINT, signal.SIG_DFL)
    restore = cluster.stop_on_signals()

    class Dies:
        pass

    try:
        obj = Dies()
        weakref.finalize(obj, os.kill, os.getpid(), signal.SIGINT)
        del obj   # the handler runs inside the finalizer: its Stopped is printed, not raised
        assert cluster.stop_signal == signal.SIGINT
        assert role.proc.poll() is not None
        with pytest.raises(Stopped):
            restore()
    finally:
        cluster.stop()
        signal.signal(signal.SIGINT, outer)
