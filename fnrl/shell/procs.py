"""Role processes: started in their own session and killed with the job that started
them; stopped as whole process groups; reaped after a controller died without notice.

A role is spawned with `start_new_session` (a SIGINT to the controller's terminal does
not reach it; the controller stops roles in order) and PR_SET_PDEATHSIG (the kernel
SIGKILLs it when the thread that forked it ends), so a crashed controller never leaves
roles behind. vLLM's engine core is a child of its API server; it calls
`die_with_parent` itself, and `stop` ends the whole group in case it lingers.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping

_OURS = (b"fnrl", b"vllm", b"VLLM")
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """PR_SET_PDEATHSIG(sig) on Linux (a `preexec_fn`, or called in a child that
    another library forks); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def spawn(argv: list[str], log_path: str | os.PathLike, *,
          env: Mapping[str, str] | None = None, own_session: bool = True,
          with_parent: bool = True, death_signal: int = signal.SIGKILL) -> subprocess.Popen:
    """Starts `argv` with stdout and stderr appended to `log_path` and no stdin.

    own_session: leads its own session and process group (`stop` ends the group).
    with_parent: gets `death_signal` when the thread that spawned it ends
    (PR_SET_PDEATHSIG); leave it off for a process started from a short-lived thread.
    SIGTERM lets a role that owns shared memory unlink it when its job is SIGKILLed.
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=dict(env) if env is not None else None, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=own_session,
                                preexec_fn=(lambda: die_with_parent(death_signal))
                                if with_parent else None)
    proc.fnrl_log_path = Path(log_path)  # for error messages (files.log_tail)
    return proc


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Sends `sig` to the process group `proc` leads; False if the group is gone."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies included)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def group_gone(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader: a zombie still counts as a group member
    try:
        os.killpg(proc.pid, 0)
        return False
    except ProcessLookupError:
        return True


def stop(proc: subprocess.Popen, grace_s: float = 10.0, *, group: bool = True) -> None:
    """SIGTERM, then SIGKILL what is left after `grace_s`; reaps the process.

    group=True: the whole group `proc` leads, signalled even if the leader already
    exited (a child may have outlived it), and waited on until every member is gone.
    group=False: the process alone (one that shares its parent's group).
    """
    stop_all([proc], grace_s, group=group)


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float = 10.0, *,
             group: bool = True) -> None:
    """`stop` for several processes at once, sharing one grace period."""
    procs = list(procs)
    for proc in procs:
        if group:
            signal_group(proc, signal.SIGTERM)
        elif proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        if not _wait(proc, deadline, group):
            if group:
                signal_group(proc, signal.SIGKILL)
            else:
                proc.kill()
            _wait(proc, time.monotonic() + grace_s, group)
        proc.wait(grace_s)


def _wait(proc: subprocess.Popen, deadline: float, group: bool) -> bool:
    while True:
        if group_gone(proc) if group else proc.poll() is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Fields after the parenthesised command: state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if any(tag in cmdline for tag in _OURS):
            members.append(int(entry.name))
    return members


def reap_leftovers(roles_json: Path) -> int:
    """SIGKILLs the surviving members of the role process groups a previous controller
    of this run recorded (each role leads its own session, so its pgid is its pid);
    returns how many processes were killed. Only processes whose command line is ours
    (fnrl, vLLM) are touched, so a recycled pid is left alone."""
    if not sys.platform.startswith("linux") or not roles_json.exists():
        return 0
    try:
        roles = json.loads(roles_json.read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    killed = 0
    for info in roles.values():
        for pid in _group_members(int(info["pid"])):
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
