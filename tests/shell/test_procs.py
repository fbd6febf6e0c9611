"""Role processes: own session, death with the spawning thread, group stop, reaping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fnrl.shell import procs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl, /proc")

# A parent that starts a child in its own group, prints the child's pid, then waits.
PARENT_WITH_CHILD = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
                     "'import time; time.sleep(60)']); print(c.pid, flush=True); time.sleep(60)")
# Ignores SIGTERM, so only the SIGKILL after the grace period ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_spawn_gives_its_own_session_and_logs(tmp_path):
    log = tmp_path / "role.log"
    proc = procs.spawn([sys.executable, "-c", "print('hello'); import time; time.sleep(60)"], log)
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        assert wait_for(lambda: "hello" in log.read_text())
    finally:
        procs.stop(proc, 5.0)
    assert proc.returncode is not None


def test_a_scratch_directory_is_the_roles_tmpdir_and_goes_with_it(tmp_path, monkeypatch):
    """vLLM leaves its torch file store and IPC sockets in TMPDIR: a server's own scratch
    directory goes when it is stopped, when a dead role is released, or, if its spawner
    was SIGKILLed, at the next start (remove_orphan_scratch)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))      # gettempdir() is cached: reset below
    monkeypatch.setattr(procs.tempfile, "tempdir", None)
    writes = ("import os, tempfile, time; open(os.path.join(tempfile.gettempdir(), 'vllm_dist_x'),"
              " 'w').close(); print(tempfile.gettempdir(), flush=True); time.sleep(60)")
    proc = procs.spawn([sys.executable, "-c", writes], tmp_path / "a.log", scratch=True)
    assert wait_for(lambda: (tmp_path / "a.log").read_text().strip() != "")
    scratch = (tmp_path / "a.log").read_text().split()[0]
    assert scratch == str(proc.fnrl_scratch) and (proc.fnrl_scratch / "vllm_dist_x").exists()
    assert proc.fnrl_scratch.name.startswith(f"fnrl-scratch-{os.getpid()}-")
    procs.stop(proc, 5.0)
    assert not proc.fnrl_scratch.exists()

    died = procs.spawn([sys.executable, "-c", "pass"], tmp_path / "b.log", scratch=True)
    procs.release(died)                               # still running (or not yet reaped)
    assert wait_for(lambda: died.poll() is not None and procs.group_gone(died))
    procs.release(died)
    assert not died.fnrl_scratch.exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    orphan, ours = tmp_path / f"fnrl-scratch-{dead}-abc", tmp_path / f"fnrl-scratch-{os.getpid()}-x"
    orphan.mkdir(), ours.mkdir(), (tmp_path / "fnrl-scratch-notapid").mkdir()
    assert procs.remove_orphan_scratch() == 1
    assert not orphan.exists() and ours.exists() and (tmp_path / "fnrl-scratch-notapid").exists()


def test_stop_ends_the_whole_group_and_kills_what_ignores_sigterm(tmp_path):
    proc = procs.spawn([sys.executable, "-c", PARENT_WITH_CHILD], tmp_path / "p.log")
    assert wait_for(lambda: (tmp_path / "p.log").read_text().strip() != "")
    child = int((tmp_path / "p.log").read_text().split()[0])
    assert alive(child)
    procs.stop(proc, 5.0)
    assert wait_for(lambda: not alive(child))       # the group went, not just its leader

    stubborn = procs.spawn([sys.executable, "-c", STUBBORN], tmp_path / "s.log")
    time.sleep(0.5)                                  # let it install the handler
    t0 = time.monotonic()
    procs.stop(stubborn, 0.5)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5


def test_stop_without_a_group_signals_the_process_alone(tmp_path):
    proc = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "x.log",
                       own_session=False, with_parent=False)
    assert os.getpgid(proc.pid) == os.getpgid(0)
    procs.stop(proc, 5.0, group=False)
    assert proc.returncode == -signal.SIGTERM
    assert procs.signal_group(proc, signal.SIGTERM) is False   # it led no group


def test_a_role_dies_with_the_thread_that_spawned_it(tmp_path):
    spawned = []
    thread = threading.Thread(target=lambda: spawned.append(
        procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "t.log")))
    thread.start()
    thread.join()
    assert wait_for(lambda: spawned[0].poll() is not None)
    assert spawned[0].returncode == -signal.SIGKILL


def test_reap_leftovers_kills_recorded_groups_only(tmp_path):
    ours = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)  # fnrl"],
                       tmp_path / "r.log")
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        roles = tmp_path / "roles.json"
        roles.write_text(json.dumps({"trainer": {"pid": ours.pid},
                                     "other": {"pid": bystander.pid}}))
        assert procs.reap_leftovers(roles) == 1      # `sleep` is not one of ours
        assert ours.wait(5) == -signal.SIGKILL and bystander.poll() is None
        assert procs.reap_leftovers(tmp_path / "missing.json") == 0
    finally:
        bystander.kill()
        bystander.wait()
