"""The GPU lane's report: tests, benchmark table and targets in one file (gpu_check.sh).

    python scripts/gpu_report.py OUT_DIR --platform gpu --device "NVIDIA H200" \
        --tests-rc 0 --tests-log OUT_DIR/logs/pytest.log \
        --bench qwen0.5b=0 qwen1.5b=0 --timings tests=50 qwen0.5b=61 total=300

Reads each benchmark's JSON (OUT_DIR/logs/bench_<preset>.json, lab/benchmarks/train_step.py
--json), writes OUT_DIR/gpu_check.md and OUT_DIR/gpu_check.json, prints the markdown and
exits non-zero on an error: a test failed or could not run, a benchmark crashed or wrote
nothing, or a side failed other than by running out of memory (a timeout included).
Out of memory and missed targets are results, reported with exit 0.

Targets (the issue's, on a GPU only): Qwen2.5-0.5B at 8 × 1,024 at least 1.3× PyTorch's
tokens per second; -1.5B at 8 × 2,048 fits and at least 1.2×; -3B at 8 × 2,048 at 40 %
MFU (PaLM's FLOP count, see lab/benchmarks/train_step.py), its peak memory beside the plan.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform as host
import re
import subprocess
from pathlib import Path

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
            "orbax-checkpoint", "chex", "numpy", "torch", "transformers", "pytest")
TARGETS = {   # preset: (what, goal)
    "qwen0.5b": ("fnrl/torch tokens per second", 1.3),
    "qwen1.5b": ("fits, and fnrl/torch tokens per second", 1.2),
    "qwen3b": ("fnrl MFU", 0.40),
}
FAILURES_THAT_ARE_RESULTS = ("oom",)


def versions() -> dict[str, str]:
    """Installed versions of the lane's packages (metadata only: nothing imported)."""
    out = {"python": host.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def gpu_line() -> str:
    """nvidia-smi's name, memory and driver of the cards, or "" without one."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def test_summary(log: str) -> dict:
    """pytest's counts (passed, failed, ...) and FAILED lines from its -q output."""
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", log)}
    lines = log.strip().splitlines()
    return {"counts": counts, "last_line": lines[-1] if lines else "",
            "failed": [x for x in lines if x.startswith(("FAILED", "ERROR"))]}


def evaluate(preset: str, bench: dict | None, platform: str, *, ran: bool = True) -> dict:
    """One preset's target: value, goal and status ("met", "missed", "n/a: why",
    "not run")."""
    what, goal = TARGETS[preset]
    out = {"preset": preset, "target": what, "goal": goal, "value": None}
    if platform != "gpu":
        return {**out, "status": f"n/a: targets are for a GPU (platform {platform})"}
    if not ran:
        return {**out, "status": "not run"}
    if bench is None:
        return {**out, "status": "missed: the benchmark wrote no result"}
    sides = bench["summary"]["sides"]
    fnrl = sides.get("fnrl", {})
    if "error" in fnrl:
        return {**out, "status": f"missed: fnrl failed ({fnrl['kind']})"}
    if preset == "qwen3b":
        value = fnrl.get("mfu")
        out.update(value=value, peak_device_gb=fnrl.get("peak_device_gb"),
                   xla_plan_gb=fnrl.get("xla_plan_gb"), fnrl_plan_gb=fnrl.get("fnrl_plan_gb"))
        if value is None:
            return {**out, "status": f"n/a: no peak FLOP/s known for {fnrl.get('device')}"}
    else:
        ratio = bench["summary"]["ratios"].get("torch")
        if ratio is None:
            torch = sides.get("torch", {})
            return {**out, "status": f"n/a: torch failed ({torch.get('kind', '?')})"}
        value = ratio["median"]
        out["value"] = value
    return {**out, "status": "met" if value >= goal else "missed"}


def bench_errors(preset: str, rc: int, bench: dict | None) -> list[str]:
    """Why a benchmark run is an error (not a result): crashed, no JSON, a side failed
    other than by running out of memory."""
    if rc != 0 or bench is None:
        return [f"{preset}: benchmark exited {rc}" + ("" if bench else ", no result written")]
    return [f"{preset}: {side} failed ({row['kind']}): "
            f"{row['error'].strip().splitlines()[-1][:200] if row['error'].strip() else ''}"
            for side, row in bench["summary"]["sides"].items()
            if "error" in row and row["kind"] not in FAILURES_THAT_ARE_RESULTS]


def _fmt(x, spec: str = ".1f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def bench_rows(preset: str, bench: dict) -> list[str]:
    """Markdown table rows of one preset: a row per side, then the ratios."""
    cfg = bench["config"]
    shape = f"{cfg['num_hidden_layers']}L × {cfg['hidden_size']}, {cfg['batch']} × {cfg['seq']}"
    rows = []
    for side, row in bench["summary"]["sides"].items():
        if "error" in row:
            rows.append(f"| {preset} | {shape} | {side} | failed: {row['kind']} | | | | | |")
            continue
        peak = row["peak_device_gb"]
        peak_text = _fmt(peak, ".2f") if peak is not None else f"{row['peak_rss_gb']:.2f} (host)"
        plans = (f"{_fmt(row.get('xla_plan_gb'), '.2f')} / {_fmt(row.get('fnrl_plan_gb'), '.2f')}"
                 if side == "fnrl" else "")
        rows.append(f"| {preset} | {shape} | {side} | {row['ms_per_step']:.1f} | "
                    f"{row['tokens_per_s']:,.0f} | {_fmt(row['mfu'], '.1f', 100)} | "
                    f"{peak_text} | {plans} | {row['kernels']} |")
    for side, line in bench["summary"]["ratio_lines"].items():
        rows.append(f"| {preset} | | fnrl/{side} tokens/s | {line} | | | | | |")
    return rows


def render(report: dict) -> str:
    """The markdown report."""
    r = report
    lines = [f"# fnrl GPU check: {'PASS' if not r['errors'] else 'FAIL'}", "",
             f"- platform: {r['platform']}, device: {r['device']}"
             + (f" (nvidia-smi: {r['nvidia_smi']})" if r["nvidia_smi"] else ""),
             f"- quick: {r['quick']}; seconds: " + ", ".join(f"{k} {v}" for k, v in
                                                         r["timings"].items()),
             "- versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
             "- exit status: non-zero for errors only (tests, crashes, failures other than "
             "out of memory); a side out of memory and missed targets are reported, exit 0",
             "", "## Tests (`pytest -m gpu`, FNRL_GPU_LANE=1)", "",
             f"exit {r['tests']['rc']}: `{r['tests']['last_line']}`"]
    lines += [f"- {x}" for x in r["tests"]["failed"]]
    lines += ["", "## Benchmark (lab/benchmarks/train_step.py, each side alone on the device)", "",
              "| preset | shape | side | ms/step | tokens/s | MFU % | peak GB | "
              "plan GB (XLA / fnrl) | kernels |", "|---|---|---|---|---|---|---|---|---|"]
    for preset, bench in r["benchmarks"].items():
        if bench is None:
            lines.append(f"| {preset} | | no result (exit {r['bench_rc'][preset]}) | | | | | | |")
        else:
            lines += bench_rows(preset, bench)
    lines += ["", "MFU: " + next((b["mfu_convention"] for b in r["benchmarks"].values() if b),
                                 "–") + "; peak GB: peak_bytes_in_use (fnrl) and "
              "max_memory_allocated (torch) on a GPU, process RSS on CPU.",
              "", "## Targets", "", "| preset | target | goal | value | status |",
              "|---|---|---|---|---|"]
    for t in r["targets"]:
        value = t["value"]
        memory = (f" (peak {_fmt(t.get('peak_device_gb'))} GB, plan XLA "
                  f"{_fmt(t.get('xla_plan_gb'))} / fnrl {_fmt(t.get('fnrl_plan_gb'))} GB)"
                  if t["preset"] == "qwen3b" and value is not None else "")
        shown = ("–" if value is None else f"{100 * value:.1f} %" if t["preset"] == "qwen3b"
                 else f"{value:.2f}×")
        goal = f"{100 * t['goal']:.0f} %" if t["preset"] == "qwen3b" else f"≥ {t['goal']}×"
        lines.append(f"| {t['preset']} | {t['target']} | {goal} | {shown}{memory} | "
                     f"{t['status']} |")
    if r["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in r["errors"]]
    return "\n".join(lines) + "\n"


def _pairs(items: list[str]) -> dict[str, str]:
    return dict(x.split("=", 1) for x in items)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--platform", required=True)
    parser.add_argument("--device", default="")
    parser.add_argument("--quick", default="0")
    parser.add_argument("--tests-rc", type=int, required=True)
    parser.add_argument("--tests-log", type=Path, required=True)
    parser.add_argument("--bench", nargs="*", default=[], help="PRESET=EXIT_STATUS")
    parser.add_argument("--timings", nargs="*", default=[], help="PHASE=SECONDS")
    args = parser.parse_args()

    log = args.tests_log.read_text() if args.tests_log.exists() else ""
    tests = {"rc": args.tests_rc, **test_summary(log)}
    bench_rc = {k: int(v) for k, v in _pairs(args.bench).items()}
    benchmarks, errors = {}, []
    for preset, rc in bench_rc.items():
        path = args.out_dir / "logs" / f"bench_{preset}.json"
        benchmarks[preset] = json.loads(path.read_text()) if path.exists() else None
        errors += bench_errors(preset, rc, benchmarks[preset])
    if args.tests_rc != 0:
        errors.insert(0, f"tests exited {args.tests_rc}: {tests['last_line']}")
    targets = [evaluate(p, benchmarks.get(p), args.platform, ran=p in bench_rc)
               for p in TARGETS]
    report = {"platform": args.platform, "device": args.device, "quick": args.quick == "1",
              "nvidia_smi": gpu_line(), "versions": versions(),
              "timings": {k: int(v) for k, v in _pairs(args.timings).items()},
              "tests": tests, "bench_rc": bench_rc, "benchmarks": benchmarks,
              "targets": targets, "errors": errors}
    text = render(report)
    (args.out_dir / "gpu_check.md").write_text(text)
    (args.out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(text)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
