"""A simulated run's directory, written like the real job's: config.json, metrics.jsonl
(one `train` record per step with fnrl.control.report's keys), summary.json,
timeline.json and sim.png (throughput, idle share per role, staleness histogram, a few
rollouts over time); with a cost table given (a user's costs file merged in), costs.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from fnrl.control.metrics import MetricsWriter, staleness_histogram
from fnrl.sim.cluster import Simulation
from fnrl.sim.config import SimConfig


def run_dir_for(cfg: SimConfig) -> Path:
    return Path(cfg.out or f"runs/sim-{cfg.preset}-{cfg.gpus}")


def simulate(cfg: SimConfig, run_dir: Path | None = None, *, table: dict | None = None) -> dict:
    """Runs `cfg` (over `table`, by default the built-in costs.toml) and writes its run
    directory; returns the summary."""
    run_dir = run_dir or run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    if table is not None:
        # The costs the run used, so that it re-runs without the user's file.
        (run_dir / "costs.json").write_text(json.dumps(table, indent=1))
    writer = MetricsWriter(run_dir)
    try:
        sim = Simulation(cfg, writer=writer, table=table)
        summary = sim.run()
    finally:
        writer.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (run_dir / "timeline.json").write_text(json.dumps(sim.timeline))
    if cfg.plots:
        plot_sim(run_dir, sim.step_records, sim.timeline, summary)
    return summary


def plot_sim(run_dir: Path, records: list[dict], timeline: list[dict], summary: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(22, 4))
    steps = [r["step"] if "step" in r else i + 1 for i, r in enumerate(records)]
    ax[0].plot(steps, [r["trained_tokens_per_s"] for r in records], lw=1, label="per step")
    ax[0].plot(steps, [r["trained_tokens_per_s_cum"] for r in records], lw=1, label="cumulative")
    ax[0].set(title=f"trained tokens/s ({summary['preset']}, {summary['gpus']} GPUs)",
              xlabel="step", ylabel="tokens/s")
    ax[0].legend(fontsize=8)
    idle = {"trainer": summary["trainer_idle_frac"], "rollouts (nothing placed)":
            summary["rollout_idle_frac"], "rollouts (not decoding)": summary["rollout_decode_idle_frac"]}
    ax[1].bar(range(len(idle)), list(idle.values()), color=["tab:red", "tab:blue", "tab:cyan"])
    ax[1].set_xticks(range(len(idle)), list(idle), fontsize=7)
    ax[1].set(title="GPU idle share per role", ylim=(0, 1))
    hist = staleness_histogram(records)
    ax[2].bar(np.arange(len(hist)), hist)
    ax[2].set(title=f"staleness of trained tokens (η={summary['eta']})",
              xlabel="trainer version − token version", ylabel="tokens")
    samples = [x for x in timeline if "running" in x]
    if samples:
        t = np.array([x["t"] for x in samples])
        running = np.array([x["running"] for x in samples])
        for k in range(running.shape[1]):
            ax[3].step(t, running[:, k], where="post", lw=0.8, label=f"rollout {k}")
    for e in timeline:
        if e.get("event") == "train":
            ax[3].axvspan(e["t0"], e["t"], color="tab:red", alpha=0.08)
    ax[3].set(title="trajectories placed on a few rollouts (red: train steps)",
              xlabel="virtual seconds", ylabel="trajectories")
    fig.tight_layout()
    out = run_dir / "sim.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
