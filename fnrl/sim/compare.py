"""Presets side by side on one cluster and workload (`python -m fnrl.sim compare`).

Each preset is simulated by `fnrl.sim.report.simulate` into its own run directory under
the comparison's, at its own staleness bound η unless the config pins one; the comparison
writes compare.json (the rows), compare.md (the table and the setup) and compare.png."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fnrl.config.presets import PRESETS
from fnrl.sim.config import SimConfig
from fnrl.sim.report import simulate

COLUMNS = (
    ("preset", "preset", "{}"),
    ("eta", "η", "{}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("x_best", "× best", "{:.2f}"),
    ("x_sync", "× sync", "{:.2f}"),
    ("trainer_idle", "trainer idle", "{:.2f}"),
    ("rollout_idle", "rollout idle", "{:.2f}"),
    ("interrupts_per_traj", "interrupts/traj", "{:.2f}"),
    ("max_staleness", "max staleness", "{}"),
)
"""(row key, header, format) of the printed and markdown tables. Throughput is the seeds'
metric: trained prompt + response tokens per second of virtual time."""


def compare_dir_for(cfg: SimConfig) -> Path:
    return Path(cfg.out or f"runs/sim-compare-{cfg.gpus}")


def compare(cfg: SimConfig, presets: tuple[str, ...], *, table: dict | None = None,
            out: Path | None = None) -> list[dict]:
    """Simulates `cfg` under each of `presets` (cfg.preset is ignored; cfg.eta >= 0 pins η
    for all) and writes the comparison's files; returns one row per preset."""
    if not presets or len(set(presets)) != len(presets) or not set(presets) <= set(PRESETS):
        raise ValueError(f"invalid config presets={presets!r}: must name distinct presets "
                         f"of {sorted(PRESETS)}")
    out = out or compare_dir_for(cfg)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in presets:
        run = dataclasses.replace(cfg, preset=preset, out=str(out / preset))
        s = simulate(run, out / preset, table=table)
        rows.append({
            "preset": preset, "eta": s["eta"], "eta_pinned": cfg.eta >= 0,
            "tokens_per_s": s["trained_seq_tokens_per_s"],
            "response_tokens_per_s": s["trained_tokens_per_s"],
            "trainer_idle": s["trainer_idle_frac"], "rollout_idle": s["rollout_idle_frac"],
            "interrupts_per_traj": s["interrupted"] / max(s["trajectories"], 1),
            "max_staleness": s["staleness_checked_max"], "train_wall_s": s["train_wall_s"],
            "run_dir": str(out / preset)})
    best = max(r["tokens_per_s"] for r in rows)
    sync = next((r["tokens_per_s"] for r in rows if r["preset"] == "sync"), None)
    for r in rows:
        r["x_best"] = r["tokens_per_s"] / best if best > 0 else float("nan")
        r["x_sync"] = r["tokens_per_s"] / sync if sync else None
    (out / "compare.json").write_text(json.dumps(
        {"config": dataclasses.asdict(cfg), "presets": list(presets), "rows": rows}, indent=1))
    (out / "compare.md").write_text(compare_markdown(cfg, rows))
    plot_compare(out, rows)
    return rows


def _cells(row: dict) -> list[str]:
    cells = []
    for key, _, fmt in COLUMNS:
        v = row[key]
        cells.append("—" if v is None else fmt.format(v))
    if row["eta_pinned"]:
        cells[1] += " (pinned)"
    return cells


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned plain-text table."""
    lines = [[h for _, h, _ in COLUMNS]] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def compare_markdown(cfg: SimConfig, rows: list[dict]) -> str:
    c, w = cfg.cluster, cfg.workload
    train = cfg.gpus if c.placement == "colocated" else (c.train_gpus or cfg.gpus // 2)
    eta = (f"every preset pinned at η = {cfg.eta}" if cfg.eta >= 0
           else "each preset at its own η")
    setup = (f"{cfg.gpus} × {c.gpu}, {c.model}, {c.placement} ({train} trainer GPUs, rollouts at "
             f"TP {c.rollout_tp}), {c.weight_sync} weight sync, decode {c.decode}; "
             f"{w.groups_per_step} groups of {w.group_size} a step, prompts of {w.prompt_len}, "
             f"{w.response} responses (median {w.len_median}, σ {w.len_sigma}, max {w.len_max}"
             + (f", {w.turns} turns, tool calls of {w.tool_latency_s} s" if w.turns > 1 else "")
             + f"); {cfg.steps} steps, seed {cfg.seed}; {eta}.")
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    body = ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join([
        "# Presets compared (fnrl.sim)", "", setup, "", head, rule, *body, "",
        "tokens/s: trained prompt + response tokens per second of virtual time; idle: share "
        "of GPU time; interrupts/traj: interrupts per trajectory generated; max staleness: "
        "the largest trainer version − token version trained. Each preset's run directory "
        "is beside this file.", ""])


def plot_compare(out: Path, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['preset']}\nη={r['eta']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].bar(x, [r["tokens_per_s"] for r in rows], color="tab:green")
    ax[0].set(title="trained tokens/s (prompt + response)", ylabel="tokens/s")
    width = 0.4
    ax[1].bar([i - width / 2 for i in x], [r["trainer_idle"] for r in rows], width,
              label="trainer", color="tab:red")
    ax[1].bar([i + width / 2 for i in x], [r["rollout_idle"] for r in rows], width,
              label="rollouts", color="tab:blue")
    ax[1].set(title="GPU idle share", ylim=(0, 1))
    ax[1].legend(fontsize=8)
    ax[2].bar(x, [r["interrupts_per_traj"] for r in rows], color="tab:purple")
    ax[2].set(title="interrupts per trajectory")
    for a in ax:
        a.set_xticks(list(x), names, fontsize=8)
    fig.tight_layout()
    path = out / "compare.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
