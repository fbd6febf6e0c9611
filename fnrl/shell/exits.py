"""Why a role process ended, in words: its exit code, and for a SIGKILL that fnrl did not
send, whether the kernel's out-of-memory killer sent it.

A process the OOM killer ends exits with -9 and writes nothing: its log tail says
nothing about memory. The kernel counts its OOM kills (/proc/vmstat `oom_kill`, every
kill on the host; the process's memory cgroup: `memory.events` `oom_kill` under cgroup
v2, `memory.oom_control` `oom_kill` under v1), so a count that rose while the process
ran is the evidence. `ExitWatch` reads the counts when the process starts and at every
`sample` while it is alive (and its resident memory), and `describe` compares them with
the counts after it died. The decision itself is `describe_exit`, a pure function.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OomCounts:
    """The kernel's OOM-kill counters at one moment; None where they cannot be read."""

    host: int | None
    """/proc/vmstat oom_kill: OOM kills on the whole host since boot."""
    cgroup: int | None
    """oom_kill of the process's memory cgroup (it and its descendants)."""
    cgroup_path: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExitEvidence:
    """What is known of a process that ended."""

    code: int
    """Popen.returncode: -N for a signal N."""
    signals_sent: frozenset[int] = frozenset()
    """Signals fnrl sent the process (its group) itself: a kill, a stop or an injection."""
    before: OomCounts | None = None
    """The counts at its last sample while it was alive."""
    after: OomCounts | None = None
    """The counts once it had died."""
    peak_rss_bytes: int | None = None
    """Its peak resident memory (VmHWM) at the last sample."""
    memory_pressure: str | None = None
    """/proc/pressure/memory's "full" line after it died."""


def _rose(before: int | None, after: int | None) -> int | None:
    if before is None or after is None:
        return None
    return after - before


def describe_exit(ev: ExitEvidence) -> str:
    """`"exited with code 3"`, `"was killed by the kernel's out-of-memory killer
    (code -9; ...figures)"`, `"was killed by SIGKILL from outside fnrl (...)"`, ...:
    a phrase to follow the role's name."""
    if ev.code >= 0:
        return f"exited with code {ev.code}"
    sig = -ev.code
    try:
        sig_name = signal.Signals(sig).name
    except ValueError:
        sig_name = f"signal {sig}"
    if sig in ev.signals_sent:
        return f"was killed by fnrl with {sig_name} (code {ev.code})"
    if sig != signal.SIGKILL:
        return f"was killed by {sig_name} from outside fnrl (code {ev.code})"
    before, after = ev.before, ev.after
    host = _rose(before and before.host, after and after.host)
    same_cgroup = before is not None and after is not None and \
        before.cgroup_path == after.cgroup_path
    group = _rose(before.cgroup, after.cgroup) if same_cgroup else None
    figures = []
    if host is not None:
        figures.append(f"host oom_kill {before.host} -> {after.host}")
    if group is not None:
        figures.append(f"cgroup {before.cgroup_path} oom_kill {before.cgroup} -> {after.cgroup}")
    if ev.peak_rss_bytes is not None:
        figures.append(f"its peak RSS {ev.peak_rss_bytes / 2**30:.2f} GiB")
    if ev.memory_pressure:
        figures.append(f"memory pressure {ev.memory_pressure}")
    detail = "; ".join(figures)
    # The cgroup's count is the sharper evidence (only kills among its processes); the
    # host's counts any kill, and is all there is outside a memory cgroup.
    if (group or 0) > 0 or (group is None and (host or 0) > 0):
        return (f"was killed by the kernel's out-of-memory killer (code -9: SIGKILL; "
                f"{detail}). Give it more memory or make it need less")
    if host is None and group is None:
        return (f"was killed by SIGKILL from outside fnrl (code -9; the kernel's OOM-kill "
                f"counts could not be read, so the out-of-memory killer is not ruled out"
                f"{'; ' + detail if detail else ''})")
    return (f"was killed by SIGKILL from outside fnrl (code -9; not the out-of-memory "
            f"killer: {detail})")


# --- reading the kernel's figures --------------------------------------------------------


def _field(path: Path, key: str) -> int | None:
    """The integer after `key` on a "key value" line of `path`; None if unreadable."""
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


def memory_cgroup(pid: int, *, proc: Path = Path("/proc"),
                  root: Path = CGROUP_ROOT) -> Path | None:
    """The counters file of `pid`'s memory cgroup: v2's memory.events, else v1's
    memory.oom_control; None if neither exists (no cgroup, or the process is gone)."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":          # v2 (unified): "0::/path"
            candidates += [root / rel / "memory.events",
                           root / "unified" / rel / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / rel / "memory.oom_control")
    return next((c for c in candidates if c.exists()), None)


def read_oom_counts(counters: Path | None, *, vmstat: Path = Path("/proc/vmstat")) -> OomCounts:
    """The host's and the cgroup's (`counters`, from `memory_cgroup`) OOM-kill counts."""
    return OomCounts(host=_field(vmstat, "oom_kill"),
                     cgroup=None if counters is None else _field(counters, "oom_kill"),
                     cgroup_path=None if counters is None else str(counters.parent))


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (peak resident memory) of a live process; None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_pressure() -> str | None:
    """The "full" line of /proc/pressure/memory (time all tasks stalled on memory)."""
    try:
        for line in Path("/proc/pressure/memory").read_text().splitlines():
            if line.startswith("full"):
                return line.split(" total=")[0]
    except OSError:
        pass
    return None


class ExitWatch:
    """What is known of one process while it lives, for when it is gone: the OOM
    evidence (made when it starts, `sample`d, `describe`d once it has exited), the
    signals fnrl sent it, and the semaphores its group mapped (fnrl.shell.procs)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.counters = memory_cgroup(pid)
        self.before = read_oom_counts(self.counters)
        self.peak_rss: int | None = None
        self.signals_sent: set[int] = set()
        self.semaphores: set[str] = set()   # /dev/shm/sem.mp-* its group mapped (procs)

    def sample(self) -> None:
        """Refresh the baseline (call it while the process is alive: a kill counted
        before this is not the process's)."""
        counts = read_oom_counts(self.counters)
        rss = peak_rss_bytes(self.pid)
        if rss is None:      # gone (or a zombie): the counts may include its own kill
            return
        self.peak_rss, self.before = rss, counts

    def describe(self, code: int) -> str:
        """`describe_exit` with the figures now."""
        return describe_exit(ExitEvidence(
            code=code, signals_sent=frozenset(self.signals_sent), before=self.before,
            after=read_oom_counts(self.counters), peak_rss_bytes=self.peak_rss,
            memory_pressure=memory_pressure()))
