"""The main job with its trainer as two JAX processes on one global mesh (loopback, one
CPU device each): versions advance and are served, checkpoints restore, and a rank killed
mid-run takes its group down and the group comes back from the checkpoint, losing and
repeating nothing."""

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


def test_two_process_trainer_trains_serves_and_restores(tmp_path, cache_dir, capsys):
    run_dir = tmp_path / "run"
    assert main(["--steps", "3", "--eval.every", "100", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, *GROUP, *SMALL]) == 0
    # Two trainer processes joined one group of two, behind the one trainer role.
    group = _group(run_dir)
    assert len(group["pids"]) == 2 and group["coordinator"].startswith("127.0.0.1:")
    roles = json.loads((run_dir / "roles.json").read_text())
    assert roles["trainer"]["pid"] == group["leader"]
    logs = {0: (run_dir / "logs" / "trainer.log").read_text(),
            1: (run_dir / "logs" / "trainer.rank1.log").read_text()}
    for rank, text in logs.items():
        assert (f"trainer process {rank} of 2 joined (coordinator {group['coordinator']}, "
                f"2 devices, pid {group['pids'][rank]})") in text, text[-2000:]
    # No process of the group outlives the job.
    assert all(exited(pid) for pid in [group["leader"], *group["pids"]])
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert max(max(r["rollout_versions"]) for r in train) >= 1   # new versions were served
    assert list((run_dir / "checkpoints").iterdir())
    # The same run directory resumes: a new group restores the checkpoint (and replays
    # the batches logged after it) and goes on from version 3.
    capsys.readouterr()
    assert main(["--steps", "4", "--eval.every", "100", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, *GROUP, *SMALL]) == 0
    assert "trainer ready at version 3 (resumed from step 3)" in capsys.readouterr().out
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train][-1] == 4


def test_a_killed_rank_restarts_the_whole_group_from_its_checkpoint(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    steps = 6
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnrl.experiments.math_grpo", "--steps", str(steps),
         "--eval.every", "100", "--run-dir", str(run_dir), "--warm-start.cache-dir", cache_dir,
         "--rollout.num-servers", "2", *GROUP, *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count('"kind": "train"') < 2:
            assert proc.poll() is None, proc.communicate()[0][-5000:]
            assert time.monotonic() < deadline, "no second step in 600 s"
            time.sleep(0.2)
        first = _group(run_dir)
        os.kill(first["pids"][1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-5000:]
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
    events = read_jsonl(run_dir / "faults.jsonl")
    assert [e["role"] for e in events if e["event"] == "recovered"] == ["trainer"]
    assert_nothing_lost(run_dir, steps=steps, eta=2)
