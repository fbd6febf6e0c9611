"""A process another host started: fnrl.shell.procs hands its calls to that host, and
the loopback namespace the Ray test cluster runs in sees nothing but 127.0.0.1."""

import signal
import subprocess
import sys

from fnrl.shell import procs
from fnrl.shell.hosted import HostedProcess


class RecordingHost:
    """A host that runs real local processes and records what it was asked."""

    def __init__(self):
        self.calls, self.procs = [], {}

    def start(self, argv, log_path):
        proc = procs.spawn(argv, log_path)
        self.procs[proc.pid] = proc
        return HostedProcess(self, proc.pid, log_path, node="b")

    def poll(self, pid):
        self.calls.append(("poll", pid))
        return self.procs[pid].poll()

    def signal_group(self, pid, sig):
        self.calls.append(("signal_group", pid, sig))
        return procs.signal_group(self.procs[pid], sig)

    def stop_all(self, pids, graces):
        self.calls.append(("stop_all", tuple(pids)))
        procs.stop_all([self.procs[p] for p in pids], list(graces))

    def exit_reason(self, pid):
        return procs.exit_reason(self.procs[pid])

    def sample(self, pid):
        self.calls.append(("sample", pid))


def test_procs_hands_a_hosted_process_to_its_host(tmp_path):
    host = RecordingHost()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    a, b = host.start(sleeper, tmp_path / "a.log"), host.start(sleeper, tmp_path / "b.log")
    local = procs.spawn(sleeper, tmp_path / "c.log")
    procs.sample(a)
    assert a.poll() is None and ("sample", a.pid) in host.calls
    assert procs.signal_group(a, signal.SIGKILL)
    assert a.wait(timeout=30) == -signal.SIGKILL
    assert procs.exit_reason(a).endswith("on node b") and "SIGKILL" in procs.exit_reason(a)
    # One stop for the hosted and the local process: the host stops its own.
    procs.stop_all([b, local], 5.0)
    assert ("stop_all", (b.pid,)) in host.calls
    assert b.poll() is not None and local.poll() is not None


def test_the_loopback_namespace_has_only_lo_and_reaches_nothing_else():
    code = ("from fnrl.shell.netns import enter_loopback_namespace, interfaces;"
            "import socket; enter_loopback_namespace(); print(interfaces());"
            "s = socket.socket(); s.settimeout(2)\n"
            "try:\n    s.connect(('8.8.8.8', 53)); print('reached')\n"
            "except OSError as e:\n    print('unreachable', e.errno)\n"
            "srv = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection("
            "srv.getsockname()); print('loopback ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    assert out[0] == "['lo']" and out[1].startswith("unreachable") and out[2] == "loopback ok"
