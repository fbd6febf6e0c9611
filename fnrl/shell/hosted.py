"""A role process that another host started: the controller's handle on it.

On a multi-node cluster (fnrl.backends.ray_cluster) a process is started by the node
host of the node it runs on, which keeps its `subprocess.Popen` and answers for it.
The controller holds a `HostedProcess`: the subset of Popen the job uses (pid, poll,
wait, returncode), and what fnrl.shell.procs does to a local process (signal its group,
stop it, say how it ended, sample its OOM evidence), each one a call to that host.
fnrl.shell.procs hands a HostedProcess's calls to it, so code that starts, watches and
stops roles reads the same for both.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol, Sequence


class ProcessHost(Protocol):
    """What a node's host does for the processes it started (by pid, on its node)."""

    def poll(self, pid: int) -> int | None: ...

    def signal_group(self, pid: int, sig: int) -> bool: ...

    def stop_all(self, pids: Sequence[int], graces: Sequence[float]) -> None: ...

    def exit_reason(self, pid: int) -> str: ...

    def sample(self, pid: int) -> None: ...


class HostedProcess:
    """Popen's interface over a process another host started and watches."""

    POLL_S = 0.05

    def __init__(self, host: ProcessHost, pid: int, log_path: str | Path, node: str):
        self.host, self.pid, self.node = host, pid, node
        self.fnrl_log_path = Path(log_path)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.host.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"process {self.pid} on node {self.node} still runs "
                                   f"after {timeout:g} s")
            time.sleep(self.POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.host.signal_group(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def __repr__(self) -> str:
        return f"HostedProcess(pid={self.pid}, node={self.node!r}, returncode={self.returncode})"
