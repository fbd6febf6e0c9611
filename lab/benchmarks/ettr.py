"""Effective training time ratio under injected faults: fnrl's role restarts beside the
whole-job-restart baseline, in rounds of this script (RobustRL §5, §7).

    python -m lab.benchmarks.ettr                        # role vs job restarts, 2 rounds of 6 steps
    python -m lab.benchmarks.ettr --configs role standby job clean --rounds 3 --steps 20
    python -m lab.benchmarks.ettr --parts                # also rollout recovery and chain repair

Real runs of the main job (real vLLM, relays, trainer; real SIGKILLs), one after another
on this machine, each config once a round:
  clean      no fault: the job's wall time without failures;
  role       `--faults.inject.kills trainer:every=K`: the trainer is killed at a random point of
             every K-th step and only it restarts (from the step's checkpoint) while the
             rollouts keep generating;
  standby    the same, with `--faults.trainer-standby`: a warm spare trainer takes over;
  job        the same kills with `--faults.policy job`: every role restarts from the
             checkpoint and the controller's journal (the ByteRobust-style baseline).
  parts      (--parts, once, after the rounds) two rollouts and three relays: rollout 1
             killed mid-generation, then the middle relay and the master relay, to time
             rollout recovery and chain repair.
ETTR (fnrl.control.report, over every attempt of a run, from the run's own
attempts.jsonl) = 1 − role-seconds not doing useful work / role-seconds in all, counted
from the first attempt's loop start. Units: the trainer, every rollout and every relay.
A role is down from the moment it stops doing useful work (the start of the step a
trainer kill loses, a rollout's kill, a relay's last answer) until it serves again; a
rollout with nothing to do while the trainer is down counts as down; between attempts
(a job restart) every role is down until the restarted loop runs.

Held-out evaluation is charged to no restart kind. By default it is off in every run
(`--eval.server off`). With `--with-eval`, every attempt evaluates its starting version
before its loop starts; a job restart's gap leaves that evaluation out
(report.across_attempts), as a role restart never runs one, and the attempt's wall time
ends with its loop, not after the final evaluation. (Before, the gap included it, and
the job restart's lost time with it; the old figure is printed beside the new.)

Method (lab/benchmarks/rounds.py): each round runs every config once, in an order that
varies from round to round (each config in each place equally often); a round's ratio
is a config's lost role-time (1 − ETTR) over the role restart's in the same round, and
the median with its min–max spread over rounds is printed beside each config's ETTR.
Every config runs the same job with the same thread settings (the environment line).
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

from fnrl.control.metrics import read_jsonl

from lab.benchmarks.rounds import Spread, environment, load, round_orders

CONFIGS = ("clean", "role", "standby", "job")
NAMES = {"clean": "no fault", "role": "role restart", "standby": "role + standby",
         "job": "job restart"}


def config_flags(name: str, kill_every: int) -> list[str]:
    """The main job's flags that make `name` (beside the shared --steps)."""
    kill = ["--faults.inject.kills", f"trainer:every={kill_every}"]
    return {"clean": [], "role": kill, "standby": [*kill, "--faults.trainer-standby"],
            "job": [*kill, "--faults.policy", "job", "--faults.max-job-restarts", "1000"]}[name]


def run_job(name: str, out: Path, args: list[str]) -> dict:
    """One run of the main job in out/name; its summary, fault events and wall time."""
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
    events = read_jsonl(run_dir / "faults.jsonl")
    print(f"[{name}] done in {elapsed:.0f} s", flush=True)
    return {"summary": summary, "events": events, "elapsed_s": elapsed}


def _recoveries(events: list[dict], prefix: str) -> list[dict]:
    return [e for e in events if e["event"] == "recovered" and e["role"].startswith(prefix)]


def down_per_kill(run: dict, job: bool) -> list[float]:
    """Seconds each trainer kill cost: a job restart's gaps between attempts (evaluation
    left out), or the trainer's own outage for a role restart."""
    if job:
        return list(run["summary"].get("restart_gaps_s", []))
    return [e["down_s"] for e in _recoveries(run["events"], "trainer")]


def ettr_eval_charged(summary: dict) -> float:
    """The run's ETTR measured as before: every restarted attempt's pre-loop evaluation
    counted as down time of every unit (and as wall time). Equal to the ETTR for a run
    of one attempt."""
    evals = sum(summary.get("eval_before_start_s", [])[1:])
    units, wall = summary["ettr_units"], summary.get("wall_s_all_attempts", 0.0)
    if not evals or not wall:
        return summary["ettr"]
    down = summary["role_down_s_all"] + units * evals
    return 1.0 - down / (units * (wall + evals))


def _parts(out: Path, extra: list[str]) -> None:
    run = run_job("parts", out, [
        "--steps", "12", "--eval.every", "100", "--rollout.num-servers", "2",
        "--relay.num-relays", "3", "--faults.inject.kills", "rollout1:at=4", "relay1:at=7",
        "relay0:at=10", *extra])
    for e in _recoveries(run["events"], "rollout"):
        over = e["since_detected_s"] - e["server_start_s"]
        print(f"rollout recovery ({e['role']}): {e['since_detected_s']:.1f} s from detection "
              f"to serving the newest version; its server's own start {e['server_start_s']:.1f} s; "
              f"difference {over:.1f} s (goal <= 5 s); down {e['down_s']:.1f} s since the kill")
    for e in (e for e in run["events"] if e["event"] == "chain_repaired"):
        print(f"chain repair after killing {e['role']} ({e['cause']}): "
              f"{e['repair_s'] * 1e3:.0f} ms from its last answer to the survivors' new places "
              f"(goal < 1000 ms); master now {e['master']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-every", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every config, order varying")
    p.add_argument("--configs", nargs="+", default=["role", "job"], choices=CONFIGS,
                   help="configs run each round; ratios are over 'role' (or the first given)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds' config order")
    p.add_argument("--parts", action="store_true", help="also the rollout/relay recovery run")
    p.add_argument("--with-eval", action="store_true",
                   help="keep held-out evaluation on (default: --eval.server off in every run)")
    p.add_argument("--out", default="", help="directory for the runs (default: a temp dir)")
    p.add_argument("extra", nargs="*", help="flags passed to every run (after --)")
    a = p.parse_args()
    configs = list(dict.fromkeys(a.configs))
    ref = "role" if "role" in configs else configs[0]
    out = Path(a.out or tempfile.mkdtemp(prefix="fnrl-ettr-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"fnrl ETTR benchmark: {a.steps} steps, trainer killed every {a.kill_every} steps, "
          f"{a.rounds} rounds of {', '.join(configs)} (runs in {out})")
    print(environment(), flush=True)

    # Evaluation is off in every config alike by default: it is not what a restart costs,
    # and on a small host its server would share the cores with the roles measured.
    no_eval = [] if a.with_eval else ["--eval.server", "off"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r, order in enumerate(round_orders(configs, a.rounds, seed=a.seed)):
        load_start = load()
        for name in order:
            flags = ["--steps", str(a.steps), *config_flags(name, a.kill_every), *no_eval, *a.extra]
            runs[name].append(run_job(f"{name}-r{r + 1}", out, flags))
        got = {c: runs[c][-1]["summary"]["ettr"] for c in configs}
        print(f"round {r + 1}/{a.rounds} ({' > '.join(order)}): "
              + "  ".join(f"{c} ETTR {got[c]:.3f}" for c in configs)
              + f"  (load {load_start} -> {load()})", flush=True)
    (out / "ettr.json").write_text(json.dumps(runs, indent=2))

    print(f"\n{'per config, over rounds':<34}" + "".join(f"{NAMES[c]:>22}" for c in configs))
    ettr = {c: Spread.of([x["summary"]["ettr"] for x in runs[c]]) for c in configs}
    print(f"{'ETTR median (min-max)':<34}"
          + "".join(f"{ettr[c].median:.3f} ({ettr[c].low:.3f}-{ettr[c].high:.3f})".rjust(22)
                    for c in configs))
    print(f"{'failures handled (per run)':<34}"
          + "".join(f"{','.join(str(x['summary']['failures']) for x in runs[c]):>22}" for c in configs))
    print(f"{'end-to-end time, median s':<34}"
          + "".join(f"{np.median([x['elapsed_s'] for x in runs[c]]):>22.0f}" for c in configs))
    downs = {c: [d for x in runs[c] for d in down_per_kill(x, c == "job")] for c in configs}
    print(f"{'down per kill (mean / max), s':<34}"
          + "".join((f"{np.mean(downs[c]):.1f} / {max(downs[c]):.1f}" if downs[c] else "-")
                    .rjust(22) for c in configs))
    if a.with_eval:
        print(f"{'held-out accuracy at the end':<34}"
              + "".join(f"{np.median([x['summary']['last_eval']['accuracy'] for x in runs[c]]):>22.3f}"
                        for c in configs))
    if "job" in configs and a.with_eval:
        before = Spread.of([ettr_eval_charged(x["summary"]) for x in runs["job"]])
        evals = [e for x in runs["job"] for e in x["summary"].get("eval_before_start_s", [])[1:]]
        print(f"job restart ETTR with each restart's evaluation charged (the old measurement): "
              f"{before.line('.3f')}; evaluation before a restarted loop "
              f"{np.mean(evals) if evals else 0.0:.1f} s mean")
    # Ratios within a round: lost role-time (1 - ETTR) over the reference's, same round.
    for c in configs:
        if c == ref or c == "clean":
            continue
        lost = Spread.of([(1 - x["summary"]["ettr"]) / max(1 - y["summary"]["ettr"], 1e-9)
                          for x, y in zip(runs[c], runs[ref])])
        print(f"lost role-time (1 - ETTR), {c} / {ref}: {lost.line()}")
    if "clean" in configs:
        for c in configs:
            if c != "clean":
                t = Spread.of([x["elapsed_s"] / y["elapsed_s"] for x, y in zip(runs[c], runs["clean"])])
                print(f"end-to-end time, {c} / clean: {t.line()}")
    if a.parts:
        _parts(out, a.extra)
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
