"""The main job with its trainer as two JAX processes on one global mesh (loopback, one
CPU device each), in one run: both processes join one group behind the one trainer role,
versions advance and are served, and a rank killed mid-run takes its group down and the
group comes back from the checkpoint (the restore), losing and repeating nothing. (A
plain resume of a finished run's directory by a new group, once a second run here, is
the same restore: tests/trainer/test_resume.py covers resuming.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main
from fnrl.shell.procs import exited

from tests.experiments.e2e_args import SMALL
from tests.experiments.test_faults_e2e import assert_nothing_lost

pytestmark = pytest.mark.slow

GROUP = ["--trainer.distributed.num-processes", "2", "--trainer.distributed.local-devices", "1"]


def _group(run_dir) -> dict:
    return json.loads((run_dir / "logs" / "trainer.group.json").read_text())


def test_a_killed_rank_restarts_the_whole_group_from_its_checkpoint(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    steps = 6
    out_path = tmp_path / "job.log"   # a file, not a pipe nobody reads while it runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnrl.experiments.math_grpo", "--steps", str(steps),
         "--eval.every", "100", "--run-dir", str(run_dir), "--warm-start.cache-dir", cache_dir,
         "--rollout.num-servers", "2", *GROUP, *SMALL],
        stdout=open(out_path, "w"), stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count('"kind": "train"') < 2:
            assert proc.poll() is None, out_path.read_text()[-5000:]
            assert time.monotonic() < deadline, "no second step in 600 s"
            time.sleep(0.2)
        first = _group(run_dir)
        # Two trainer processes joined one group of two, behind the one trainer role.
        assert len(first["pids"]) == 2 and first["coordinator"].startswith("127.0.0.1:")
        roles = json.loads((run_dir / "roles.json").read_text())
        assert roles["trainer"]["pid"] == first["leader"]
        for rank, log in enumerate(["trainer.log", "trainer.rank1.log"]):
            text = (run_dir / "logs" / log).read_text()
            assert (f"trainer process {rank} of 2 joined (coordinator {first['coordinator']}, "
                    f"2 devices, pid {first['pids'][rank]})") in text, text[-2000:]
        os.kill(first["pids"][1], signal.SIGKILL)
        assert proc.wait(timeout=600) == 0, out_path.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The whole group went (rank 0 and the leader with rank 1) and a new one came back.
    second = _group(run_dir)
    assert second["leader"] != first["leader"] and set(second["pids"]).isdisjoint(first["pids"])
    assert all(exited(pid) for pid in [first["leader"], *first["pids"], second["leader"],
                                      *second["pids"]])
    assert "trainer rank 1 was killed by SIGKILL; killing the rest of the group" in (
        run_dir / "logs" / "trainer.log").read_text()
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert max(max(r["rollout_versions"]) for r in train) >= 1   # new versions were served
    events = read_jsonl(run_dir / "faults.jsonl")
    assert [e["role"] for e in events if e["event"] == "recovered"] == ["trainer"]
    # The new group restored a checkpoint from after the two steps seen before the kill.
    assert [e["version"] for e in events if e["event"] == "recovered"][0] >= 2
    assert_nothing_lost(run_dir, steps=steps, eta=2)
