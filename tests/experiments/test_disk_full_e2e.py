"""A disk that fills mid-run, for real: the run directory on a tmpfs of its own (a mount
namespace, so nothing of the host is touched), filled by another process after step 2.

The job must stop with its own exit code and message (no traceback), write summary.json
and an `end` record, leave no temporary save directory and no process; then, with room
made, the same command resumes and finishes with every group trained exactly once.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import EXIT_DISK_FULL

from tests.experiments.e2e_args import SMALL
from tests.experiments.test_faults_e2e import assert_nothing_lost

pytestmark = pytest.mark.slow

STEPS = 6

SCRIPT = textwrap.dedent("""\
    set -u
    mount -t tmpfs -o size=400m,mode=0700 tmpfs "$MNT"
    run() { exec "$PYTHON" -m fnrl.experiments.math_grpo --steps $STEPS --eval.every 100 \\
              --run-dir "$MNT/run" --warm-start.cache-dir "$CACHE" $ARGS; }
    (run > "$OUT/first.out" 2> "$OUT/first.err") &
    job=$!
    # Another process fills the disk once step 2 is in (a condition, not a delay), and
    # keeps it full: every byte the job frees (a failed save's files, an old checkpoint)
    # is taken again, but for a margin (256 KiB) that the stop's own records fit in and
    # the job's next steps do not. The controller is held still while the disk first
    # fills, so the run cannot finish before it is full, however fast this machine.
    until grep -q '"step": 2' "$MNT/run/metrics.jsonl" 2>/dev/null; do
        kill -0 $job 2>/dev/null || break
        sleep 0.2
    done
    n=0
    fill() {
        free=$(( $(stat -f -c '%a' "$MNT") * $(stat -f -c '%S' "$MNT") ))
        if [ $free -gt 262144 ]; then
            n=$((n + 1))
            fallocate -l $((free - 262144)) "$MNT/filler.$n" 2>/dev/null || true
        fi
    }
    kill -STOP $job
    fill
    kill -CONT $job
    (while true; do fill; sleep 0.1; done) &
    filler=$!
    wait $job
    echo $? > "$OUT/first.rc"
    ls -a "$MNT/run/checkpoints" > "$OUT/first.checkpoints"
    pgrep -f "$MNT/run" > "$OUT/first.left"
    cp -a "$MNT/run" "$OUT/first"
    kill $filler; wait $filler
    rm "$MNT"/filler.*                     # room made: the same command resumes
    (run > "$OUT/second.out" 2> "$OUT/second.err")
    echo $? > "$OUT/second.rc"
    cp -a "$MNT/run" "$OUT/second"
""")


def test_a_disk_that_fills_mid_run_stops_the_job_cleanly_and_a_resume_loses_nothing(
        tmp_path, cache_dir):
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    env = {**os.environ, "MNT": str(mnt), "OUT": str(out), "CACHE": cache_dir,
           "PYTHON": sys.executable, "STEPS": str(STEPS), "ARGS": " ".join(SMALL)}
    # A user and mount namespace: the tmpfs exists for this script alone.
    done = subprocess.run(["unshare", "--map-root-user", "--mount", "bash", "-c", SCRIPT],
                          env=env, capture_output=True, text=True, timeout=1500)
    if not (out / "first.rc").exists():
        pytest.skip(f"no mount namespace here: {done.stderr[-500:]}")
    first_err = (out / "first.err").read_text()
    assert int((out / "first.rc").read_text()) == EXIT_DISK_FULL, first_err[-3000:]
    assert "stopped: no space left on the device of" in first_err
    assert "Traceback" not in first_err, first_err[-3000:]
    first = out / "first"
    summary = json.loads((first / "summary.json").read_text())
    assert "no space left" in summary["disk_full"] and summary["killed_attempts"] == 0
    (end,) = [r for r in read_jsonl(first / "attempts.jsonl") if r["event"] == "end"]
    assert end["disk_full"] == summary["disk_full"]
    assert not [n for n in (out / "first.checkpoints").read_text().split() if "tmp" in n]
    assert not (out / "first.left").read_text().strip(), "a process outlived the job"
    assert int((out / "second.rc").read_text()) == 0, (out / "second.err").read_text()[-3000:]
    assert_nothing_lost(out / "second", steps=STEPS, eta=2)
