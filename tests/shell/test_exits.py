"""A role's end in words: the pure classification from its exit code and the kernel's
OOM-kill counts, the readers of those counts (cgroup v1 and v2 layouts), and real
processes killed by fnrl and from outside it."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from fnrl.shell import procs
from fnrl.shell.exits import ExitEvidence, OomCounts, describe_exit, memory_cgroup, read_oom_counts

OOM = "out-of-memory killer"


def counts(host, cgroup, path="/sys/fs/cgroup/job"):
    return OomCounts(host=host, cgroup=cgroup, cgroup_path=path)


def test_a_normal_exit_and_an_error_exit_give_their_code():
    assert describe_exit(ExitEvidence(code=0)) == "exited with code 0"
    assert describe_exit(ExitEvidence(code=3)) == "exited with code 3"


def test_a_sigkill_counted_by_the_cgroup_is_the_oom_killer_with_its_figures():
    text = describe_exit(ExitEvidence(code=-9, before=counts(5, 1), after=counts(6, 2),
                                      peak_rss_bytes=14 * 2**30,
                                      memory_pressure="full avg10=41.00"))
    assert text.startswith("was killed by the kernel's out-of-memory killer (code -9")
    for figure in ("oom_kill 1 -> 2", "host oom_kill 5 -> 6", "14.00 GiB", "avg10=41.00"):
        assert figure in text


def test_an_oom_kill_elsewhere_on_the_host_does_not_count_when_the_cgroup_saw_none():
    text = describe_exit(ExitEvidence(code=-9, before=counts(5, 1), after=counts(6, 1)))
    assert text.startswith("was killed by SIGKILL from outside fnrl") and "not the " + OOM in text


def test_without_a_memory_cgroup_the_host_count_decides():
    oom = describe_exit(ExitEvidence(code=-9, before=counts(5, None, None),
                                     after=counts(6, None, None)))
    assert OOM in oom and "host oom_kill 5 -> 6" in oom
    outside = describe_exit(ExitEvidence(code=-9, before=counts(5, None, None),
                                         after=counts(5, None, None)))
    assert outside.startswith("was killed by SIGKILL from outside fnrl")


def test_unreadable_counts_do_not_rule_the_oom_killer_out():
    text = describe_exit(ExitEvidence(code=-9, before=counts(None, None, None),
                                      after=counts(None, None, None)))
    assert "from outside fnrl" in text and "not ruled out" in text


def test_a_signal_fnrl_sent_is_fnrls_even_when_oom_kills_were_counted():
    text = describe_exit(ExitEvidence(code=-9, signals_sent=frozenset({signal.SIGKILL}),
                                      before=counts(5, 1), after=counts(6, 2)))
    assert text == "was killed by fnrl with SIGKILL (code -9)"
    assert describe_exit(ExitEvidence(code=-15)) == \
        "was killed by SIGTERM from outside fnrl (code -15)"


@pytest.mark.parametrize("layout", ["v2", "hybrid", "v1"])
def test_the_counters_file_of_each_cgroup_layout_is_found_and_read(tmp_path, layout):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "42").mkdir(parents=True)
    line, counters = {
        "v2": ("0::/job/a\n", root / "job/a/memory.events"),
        "hybrid": ("4:cpu:/\n0::/job/a\n", root / "unified/job/a/memory.events"),
        "v1": ("4:memory:/job/a\n0::/\n", root / "memory/job/a/memory.oom_control"),
    }[layout]
    (proc / "42" / "cgroup").write_text(line)
    counters.parent.mkdir(parents=True)
    counters.write_text("low 0\nhigh 0\noom 3\noom_kill 2\n" if layout != "v1"
                        else "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 10\noom_kill 7\n")
    assert memory_cgroup(42, proc=proc, root=root) == counters
    assert read_oom_counts(counters, vmstat=vmstat) == OomCounts(
        host=7, cgroup=2, cgroup_path=str(counters.parent))
    assert memory_cgroup(43, proc=proc, root=root) is None          # gone


def _sleeper(tmp_path):
    return procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"],
                       tmp_path / "child.log", with_parent=False)


def test_a_real_sigkill_from_outside_fnrl_is_named_so(tmp_path):
    proc = _sleeper(tmp_path)
    procs.sample(proc)
    os.kill(proc.pid, signal.SIGKILL)       # not through fnrl
    proc.wait()
    reason = procs.exit_reason(proc)
    assert reason.startswith("was killed by SIGKILL from outside fnrl (code -9")
    assert "GiB" in reason                 # its peak RSS was sampled


def test_a_real_kill_by_fnrl_is_named_so(tmp_path):
    proc = _sleeper(tmp_path)
    procs.signal_group(proc, signal.SIGKILL)
    proc.wait()
    assert procs.exit_reason(proc) == "was killed by fnrl with SIGKILL (code -9)"
    proc = _sleeper(tmp_path)
    procs.stop(proc, grace_s=5)
    assert procs.exit_reason(proc) == "was killed by fnrl with SIGTERM (code -15)"


SEMAPHORE_HOLDER = """
import multiprocessing, sys, time
lock = multiprocessing.get_context("spawn").Lock()   # named, with a resource tracker
print(lock._semlock.name, flush=True)
time.sleep(600)
"""


def _holder(tmp_path) -> tuple:
    log = tmp_path / "holder.log"
    proc = procs.spawn([sys.executable, "-c", SEMAPHORE_HOLDER], log, with_parent=False)
    deadline = time.monotonic() + 60
    while not log.read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)
    path = "/dev/shm/sem." + log.read_text().split()[0].lstrip("/")
    assert os.path.exists(path)
    return proc, path


def test_a_group_sigkill_unlinks_the_semaphores_its_resource_tracker_would_have(tmp_path):
    # SIGKILLing the whole group kills Python's resource tracker too, which would have
    # unlinked the semaphore once its users died (vLLM's API server has one).
    proc, path = _holder(tmp_path)
    try:
        assert procs.group_semaphores(proc.pid) == [path]
        procs.signal_group(proc, signal.SIGKILL)
        proc.wait()
        assert not os.path.exists(path)
    finally:
        procs.stop(proc, grace_s=5)


def test_a_stop_unlinks_the_semaphores_of_a_group_whose_tracker_was_killed(tmp_path):
    # vLLM's shutdown force-kills its subprocesses, the resource tracker among them.
    proc, path = _holder(tmp_path)
    try:
        procs.sample(proc)                       # the controller's sampler notes it
        (tracker,) = [p for p in procs._group_members(proc.pid, ours_only=False)
                      if p != proc.pid]
        os.kill(tracker, signal.SIGKILL)
        procs.stop(proc, grace_s=5)
        assert not os.path.exists(path)
    finally:
        procs.stop(proc, grace_s=5)
