"""Role processes: started in their own session and killed with the job that started
them; stopped as whole process groups; reaped after a controller died without notice.

A role is spawned with `start_new_session` (a SIGINT to the controller's terminal does
not reach it; the controller stops roles in order) and PR_SET_PDEATHSIG (the kernel
SIGKILLs it when the thread that forked it ends), so a crashed controller never leaves
roles behind. vLLM's engine core is a child of its API server; it calls
`die_with_parent` itself, and `stop` ends the whole group in case it lingers.

Python's multiprocessing resource tracker (vLLM's API server starts one) is what unlinks
a group's named semaphores (/dev/shm/sem.mp-*) when their users die, and it dies first
when the group is SIGKILLed as a whole, or when vLLM's own shutdown force-kills its
subprocesses (seen on a Ctrl-C mid-run: one sem.mp-* left). So `sample` notes the
semaphores a group maps, and `signal_group` (SIGKILL) and `stop` unlink what is left of
them once the group is going or gone.

A process spawned with `scratch=True` gets a temporary directory of its own as TMPDIR:
vLLM leaves a torch file store (`vllm_dist_*`) and its ZeroMQ IPC sockets in the
temporary directory and never removes them (about 4 files a server start, seen by the
thousand in /tmp). `stop` removes the directory once the group is gone; the name holds
the spawning process's pid, so `remove_orphan_scratch` (at the next start) removes what
a SIGKILLed controller's roles left.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from fnrl.shell import auth
from fnrl.shell.exits import ExitWatch
from fnrl.shell.hosted import HostedProcess

_OURS = (b"fnrl", b"vllm", b"VLLM")
SCRATCH_PREFIX = "fnrl-scratch-"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """PR_SET_PDEATHSIG(sig) on Linux (a `preexec_fn`, or called in a child that
    another library forks); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def spawn(argv: list[str], log_path: str | os.PathLike, *,
          env: Mapping[str, str] | None = None, own_session: bool = True,
          with_parent: bool = True, death_signal: int = signal.SIGKILL,
          scratch: bool = False, scratch_shared: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts `argv` with stdout and stderr appended to `log_path` and no stdin.

    own_session: leads its own session and process group (`stop` ends the group).
    with_parent: gets `death_signal` when the thread that spawned it ends
    (PR_SET_PDEATHSIG); leave it off for a process started from a short-lived thread.
    SIGTERM lets a role that owns shared memory unlink it when its job is SIGKILLed.
    The environment always holds a run secret (`env`'s own, else this process's:
    fnrl.shell.auth), the only way a role gets it.
    scratch: a temporary directory of its own as TMPDIR, removed by `stop`;
    `scratch_shared` names entries of it that are the real temporary directory's (the
    caches a process keeps in its TMPDIR and should find again at its next start).
    """
    env = auth.with_secret(env)
    tmp = None
    if scratch:
        tmp = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        env["TMPDIR"] = str(tmp)
        for name in scratch_shared:   # a link: removing the scratch leaves its target
            shared = Path(tempfile.gettempdir()) / name
            shared.mkdir(mode=0o700, exist_ok=True)
            (tmp / name).symlink_to(shared, target_is_directory=True)
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=own_session,
                                    preexec_fn=(lambda: die_with_parent(death_signal))
                                    if with_parent else None)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    proc.fnrl_scratch = tmp
    proc.fnrl_log_path = Path(log_path)  # for error messages (files.log_tail)
    proc.fnrl_watch = ExitWatch(proc.pid)  # for `exit_reason`: was it the OOM killer?
    return proc


def sample(proc: subprocess.Popen) -> None:
    """Refreshes what is known of a live spawned process: its OOM evidence (peak RSS,
    the kernel's OOM-kill counts: a kill counted after this is its own) and the
    semaphores its group maps (unlinked when the group is killed or stopped)."""
    if isinstance(proc, HostedProcess):   # its node's host samples it there
        return proc.host.sample(proc.pid)
    watch = getattr(proc, "fnrl_watch", None)
    if watch is not None and proc.poll() is None:
        watch.sample()
        watch.semaphores.update(group_semaphores(proc.pid))


def _unlink_semaphores(proc: subprocess.Popen, mapped_now: Iterable[str] = ()) -> None:
    """Unlinks the group's semaphores: only its own processes use them, and none of them
    runs on (the group is SIGKILLed or gone)."""
    watch = getattr(proc, "fnrl_watch", None)
    for path in {*mapped_now, *(watch.semaphores if watch is not None else ())}:
        Path(path).unlink(missing_ok=True)


def exit_reason(proc: subprocess.Popen) -> str:
    """How an exited process ended, for an error message: "exited with code 1", "was
    killed by the kernel's out-of-memory killer (...figures)", "was killed by SIGKILL
    from outside fnrl (...)", "was killed by fnrl with SIGKILL (code -9)"."""
    code = proc.poll()
    if code is None:
        return "is still running"
    if isinstance(proc, HostedProcess):
        return f"{proc.host.exit_reason(proc.pid)} on node {proc.node}"
    watch = getattr(proc, "fnrl_watch", None)
    if watch is None:
        return f"exited with code {code}"
    return watch.describe(code)


def _sent(proc: subprocess.Popen, sig: int) -> None:
    watch = getattr(proc, "fnrl_watch", None)
    if watch is not None:
        watch.signals_sent.add(sig)


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Sends `sig` to the process group `proc` leads; False if the group is gone. A
    SIGKILL also unlinks the group's multiprocessing semaphores (the module docstring)."""
    if isinstance(proc, HostedProcess):
        return proc.host.signal_group(proc.pid, sig)
    _sent(proc, sig)
    mapped = group_semaphores(proc.pid) if sig == signal.SIGKILL else []
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if sig == signal.SIGKILL:
            _unlink_semaphores(proc, mapped)


SHM_DIR = Path("/dev/shm")


def group_semaphores(pgid: int) -> list[str]:
    """The multiprocessing named semaphores (/dev/shm/sem.mp-*) that members of process
    group `pgid` have mapped. glibc maps a semaphore under a temporary name it then
    unlinks ("sem.XXXXXX (deleted)"), so the mapping's inode is what names it."""
    inodes = set()
    for pid in _group_members(pgid, ours_only=False):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(str(SHM_DIR / "sem.")):
                inodes.add(int(fields[4]))
    found = []
    for path in SHM_DIR.glob("sem.mp-*"):
        try:
            if path.stat().st_ino in inodes:
                found.append(str(path))
        except OSError:
            continue
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies included)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def exited(pid: int) -> bool:
    """Whether the process has ended: no such pid, or a zombie its parent has not reaped."""
    if not alive(pid):
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:   # reaped between the two looks
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


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float | Sequence[float] = 10.0, *,
             group: bool = True) -> None:
    """`stop` for several processes at once, signalled together; `grace_s` is one grace
    period for all or one per process."""
    procs = list(procs)
    graces = [grace_s] * len(procs) if isinstance(grace_s, (int, float)) else list(grace_s)
    hosted = [(p, g) for p, g in zip(procs, graces) if isinstance(p, HostedProcess)]
    if hosted:   # each node's host stops its own, as below, then the local ones
        for host in {id(p.host): p.host for p, _ in hosted}.values():
            mine = [(p, g) for p, g in hosted if p.host is host]
            host.stop_all([p.pid for p, _ in mine], [g for _, g in mine])
        for proc, _ in hosted:
            proc.poll()
        local = [(p, g) for p, g in zip(procs, graces) if not isinstance(p, HostedProcess)]
        procs, graces = [p for p, _ in local], [g for _, g in local]
    for proc in procs:
        if group:
            signal_group(proc, signal.SIGTERM)
        elif proc.poll() is None:
            _sent(proc, signal.SIGTERM)
            proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    for proc, grace in sorted(zip(procs, graces), key=lambda pg: pg[1]):
        if not _wait(proc, start + grace, group):
            if group:
                signal_group(proc, signal.SIGKILL)
            else:
                _sent(proc, signal.SIGKILL)
                proc.kill()
            _wait(proc, time.monotonic() + grace, group)
        proc.wait(grace)
        if group:
            _unlink_semaphores(proc)
        _remove_scratch(proc)


def release(proc: subprocess.Popen) -> None:
    """What the group of an exited process held (its semaphores, its scratch directory),
    for a role replaced after it died; a group still running is left alone."""
    if not isinstance(proc, HostedProcess) and proc.poll() is not None and group_gone(proc):
        _unlink_semaphores(proc)
        _remove_scratch(proc)


def _remove_scratch(proc: subprocess.Popen) -> None:
    if (tmp := getattr(proc, "fnrl_scratch", None)) is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_orphan_scratch() -> int:
    """Removes the scratch directories (`spawn(scratch=True)`) whose spawning process is
    gone (a controller SIGKILLed with its roles); returns how many."""
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        try:
            owner = int(path.name[len(SCRATCH_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if owner != os.getpid() and not alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _wait(proc: subprocess.Popen, deadline: float, group: bool) -> bool:
    while True:
        if group_gone(proc) if group else proc.poll() is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _group_members(pgid: int, *, ours_only: bool = True) -> list[int]:
    """Pids in process group `pgid`; `ours_only`: whose command line is fnrl's or vLLM's."""
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
        if not ours_only or any(tag in cmdline for tag in _OURS):
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
        if info.get("node", "local") != "local":
            continue   # on another node: its host actor's end took it (fnrl.backends.ray_cluster)
        for pid in _group_members(int(info["pid"])):
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
