"""Effective training time ratio under injected faults: fnrl's role restarts beside the
whole-job-restart baseline, measured in one run of this script (RobustRL §5, §7).

    python benchmarks/ettr.py                        # the default job, trainer killed every 10 steps
    python benchmarks/ettr.py --steps 30 --kill-every 10 --out /tmp/ettr

Four real runs of the main job (real vLLM, relays, trainer; real SIGKILLs), one after
another on this machine:
  clean      no fault: the job's wall time without failures;
  role       `--faults.inject trainer:every=K`: the trainer is killed at a random point of
             every K-th step and only it restarts (from the step's checkpoint) while the
             rollouts keep generating;
  standby    the same, with `--faults.trainer-standby`: a warm spare trainer takes over;
  job        the same kills with `--faults.policy job`: every role restarts from the
             checkpoint and the controller's journal (the ByteRobust-style baseline);
  parts      two rollouts and three relays: rollout 1 killed mid-generation, then the
             middle relay and the master relay, to time rollout recovery and chain repair.
ETTR (fnrl.control.report.ettr, over every attempt) = 1 − role-seconds not doing useful
work / role-seconds in all. Units: the trainer, every rollout and every relay. A role is
down from the moment it stops doing useful work (the start of the step a trainer kill
loses, a rollout's kill, a relay's last answer) until it serves again; a rollout with
nothing to do while the trainer is down counts as down; between attempts (a job restart)
every role is down until the restarted loop runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def run_job(name: str, out: Path, args: list[str]) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "fnrl.experiments.math_grpo", "--run-dir", str(run_dir), *args]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (out / f"{name}.log").read_text()[-3000:]
        raise SystemExit(f"[{name}] failed with code {proc.returncode}:\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    events = []
    if (run_dir / "faults.jsonl").exists():
        events = [json.loads(l) for l in (run_dir / "faults.jsonl").read_text().splitlines()]
    print(f"[{name}] done in {elapsed:.0f} s", flush=True)
    return {"summary": summary, "events": events, "elapsed_s": elapsed}


def _recoveries(events: list[dict], prefix: str) -> list[dict]:
    return [e for e in events if e["event"] == "recovered" and e["role"].startswith(prefix)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-every", type=int, default=10)
    p.add_argument("--out", default="", help="directory for the runs (default: a temp dir)")
    p.add_argument("--skip", nargs="*", default=(),
                   choices=("clean", "role", "standby", "job", "parts"))
    p.add_argument("extra", nargs="*", help="flags passed to every run (after --)")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="fnrl-ettr-"))
    out.mkdir(parents=True, exist_ok=True)
    base = ["--steps", str(a.steps), *a.extra]
    kill = ["--faults.inject", f"trainer:every={a.kill_every}"]
    runs = {}
    if "clean" not in a.skip:
        runs["clean"] = run_job("clean", out, base)
    if "role" not in a.skip:
        runs["role"] = run_job("role", out, [*base, *kill])
    if "standby" not in a.skip:
        runs["standby"] = run_job("standby", out, [*base, *kill, "--faults.trainer-standby"])
    if "job" not in a.skip:
        runs["job"] = run_job("job", out, [*base, *kill, "--faults.policy", "job",
                                           "--faults.max-job-restarts", "1000"])
    if "parts" not in a.skip:
        runs["parts"] = run_job("parts", out, [
            "--steps", "12", "--eval-every", "100", "--rollout.num-servers", "2",
            "--relay.num-relays", "3", "--faults.inject", "rollout1:at=4", "relay1:at=7",
            "relay0:at=10", *a.extra])
    (out / "ettr.json").write_text(json.dumps(runs, indent=2))

    print(f"\nfnrl ETTR benchmark: {a.steps} steps, trainer killed every {a.kill_every} steps "
          f"(runs in {out})")
    cols = [c for c in ("role", "standby", "job") if c in runs]
    row = "{:<40}" + "{:>16}" * len(cols) + "{:>10}"
    names = {"role": "role restart", "standby": "role + standby", "job": "job restart"}
    print(row.format("", *(names[c] for c in cols), "goal"))
    if cols:
        sums = [runs[c]["summary"] for c in cols]
        print(row.format("ETTR", *(f"{s['ettr']:.3f}" for s in sums), ">= 0.90"))
        print(row.format("failures handled", *(s["failures"] for s in sums), ""))
        print(row.format("end-to-end time of the job, s",
                         *(f"{runs[c]['elapsed_s']:.0f}" for c in cols), ""))

        def down(c):
            if c == "job":
                gaps = runs[c]["summary"]["restart_gaps_s"]
                return f"{np.mean(gaps):.1f} / {max(gaps):.1f}"
            d = [e["down_s"] for e in _recoveries(runs[c]["events"], "trainer")]
            return f"{np.mean(d):.1f} / {max(d):.1f}"

        print(row.format("down per kill (mean / max), s", *(down(c) for c in cols), ""))
        print(row.format("held-out accuracy at the end",
                         *(f"{s['last_eval']['accuracy']:.3f}" for s in sums), ""))
    if "clean" in runs:
        c = runs["clean"]
        print(f"clean run (no fault): {c['elapsed_s']:.0f} s end to end, accuracy "
              f"{c['summary']['last_eval']['accuracy']:.3f}")
        for name in ("role", "standby", "job"):
            if name in runs:
                print(f"  {name} restart: {runs[name]['elapsed_s'] / c['elapsed_s']:.2f}x the clean run's time")
    if "parts" in runs:
        ev = runs["parts"]["events"]
        for e in _recoveries(ev, "rollout"):
            over = e["since_detected_s"] - e["server_start_s"]
            print(f"rollout recovery ({e['role']}): {e['since_detected_s']:.1f} s from detection "
                  f"to serving the newest version; its server's own start {e['server_start_s']:.1f} s; "
                  f"difference {over:.1f} s (goal <= 5 s); down {e['down_s']:.1f} s since the kill")
        for e in (e for e in ev if e["event"] == "chain_repaired"):
            print(f"chain repair after killing {e['role']} ({e['cause']}): "
                  f"{e['repair_s'] * 1e3:.0f} ms from its last answer to the survivors' new places "
                  f"(goal < 1000 ms); master now {e['master']}")


if __name__ == "__main__":
    main()
