"""An ablation's comparison: per-cell figures read from the run directories, the spread
over seeds per variant, ratios to the reference variant round by round, a markdown and
CSV table and a plot.

Figures of a cell (each from what every run writes: summary.json, metrics.jsonl):
  trained_tok_s    trained tokens per second of RL time (the summary's figure)
  generated_tok_s  generated tokens (trained or not) per second of RL time
  acc_at_tokens    held-out greedy accuracy at the same trained-token count T for every
                   cell (T: the fewest tokens any cell reached at its last evaluation),
                   linear between the cell's evaluations
  final_acc        held-out accuracy at the last evaluation
  staleness_mean   mean staleness of trained tokens (trainer version − token version)
  staleness_max, trainer_idle_frac, rollout_idle_frac, wall_s
A ratio is taken within a round (the same seed, run close in time) and its median and
range over rounds are shown, so one slow round moves the spread, not the median alone.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
import numpy as np

from fnrl.control.metrics import read_jsonl, staleness_histogram
from lab.ablation.grid import (ROUND_AXIS, AblationSpec, Cell, cell_finished,
                                           variant_name)
from lab.ablation.rounds import spread

FIGURES = ("trained_tok_s", "generated_tok_s", "acc_at_tokens", "final_acc", "staleness_mean",
           "staleness_max", "trainer_idle_frac", "rollout_idle_frac", "wall_s")
# Counters of the summary (fnrl.control.report.COUNT_KEYS and totals), per cell in cells.csv.
COUNTS = ("trained_tokens", "generated_tokens", "interrupted", "migrated", "migrations",
          "repacks", "reprefill_tokens", "pulls")
RATIO_FIGURES = ("trained_tok_s", "generated_tok_s")


def cell_figures(summary: dict, records: list[dict]) -> dict:
    """A finished cell's figures (all but acc_at_tokens) and its evaluation curve
    `eval_curve`: (trained tokens, accuracy) per evaluation, in version order."""
    train = [r for r in records if r.get("kind") == "train"]
    hist = staleness_histogram(train)
    ks = np.arange(len(hist))
    evals = sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
    rl_wall = summary.get("rl_wall_s") or float("nan")
    return {
        "trained_tok_s": float(summary["trained_tokens_per_s"]),
        "generated_tok_s": float(summary.get("generated_tokens", float("nan")) / rl_wall),
        "final_acc": float(evals[-1]["accuracy"]) if evals else float("nan"),
        "staleness_mean": float((ks * hist).sum() / hist.sum()) if hist.sum() else float("nan"),
        "staleness_max": int(ks[hist > 0].max()) if hist.sum() else 0,
        "trainer_idle_frac": float(summary.get("trainer_idle_frac", float("nan"))),
        "rollout_idle_frac": float(summary.get("rollout_idle_frac", float("nan"))),
        "wall_s": float(summary.get("wall_s_all_attempts", float("nan"))),
        "eval_curve": [(int(r["trained_tokens"]), float(r["accuracy"])) for r in evals],
        **{k: summary.get(k, "") for k in COUNTS},
    }


def accuracy_at(curve: list[tuple[int, float]], tokens: float) -> float:
    """Accuracy at `tokens` trained tokens, linear between evaluations (nan outside)."""
    if not curve or tokens > curve[-1][0] or tokens < curve[0][0]:
        return float("nan")
    xs, ys = zip(*curve)
    return float(np.interp(tokens, xs, ys))


def common_tokens(curves: list[list[tuple[int, float]]]) -> int:
    """The trained-token count every cell's evaluations reach: the smallest of their
    last evaluations' (0 when some cell has no evaluation)."""
    return min((c[-1][0] if c else 0) for c in curves) if curves else 0


def collect(spec: AblationSpec, cells: list[Cell]) -> list[dict]:
    """One row per finished cell (lab.ablation.grid.cell_finished): its
    axis values, round and figures, acc_at_tokens at the tokens every one reached."""
    rows = []
    for cell in cells:
        run_dir = spec.out_dir / cell.name
        if not cell_finished(spec, cell):
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append({"cell": cell.name, "round": cell.round, "values": dict(cell.values),
                     "variant": cell.variant, "variant_name": cell.variant_name,
                     **cell_figures(summary, read_jsonl(run_dir / "metrics.jsonl"))})
    tokens = common_tokens([r["eval_curve"] for r in rows])
    for r in rows:
        r["acc_tokens"] = tokens
        r["acc_at_tokens"] = accuracy_at(r["eval_curve"], tokens)
    return rows


def reference_variant(spec: AblationSpec) -> tuple:
    """The variant ratios are taken to: the spec's `reference`, each other axis at its
    first value."""
    chosen = dict(spec.reference)
    return tuple((p, chosen.get(p, vs[0])) for p, vs in spec.grid if p != ROUND_AXIS)


def summarize(spec: AblationSpec, rows: list[dict]) -> list[dict]:
    """One entry per variant, in grid order: the spread over rounds of every figure and
    of its per-round ratio to the reference variant (RATIO_FIGURES)."""
    ref = variant_name(reference_variant(spec))
    by_round = {(r["variant_name"], r["round"]): r for r in rows}
    ordered = sorted(rows, key=lambda r: [_grid_index(spec, p, v) for p, v in r["variant"]])
    out = []
    for name in dict.fromkeys(r["variant_name"] for r in ordered):
        mine = [r for r in rows if r["variant_name"] == name]
        entry = {"variant": mine[0]["variant"], "variant_name": name, "n": len(mine),
                 **{f: spread([r[f] for r in mine]) for f in FIGURES}}
        for f in RATIO_FIGURES:
            refs = [by_round.get((ref, r["round"])) for r in mine]
            ratios = [r[f] / b[f] for r, b in zip(mine, refs) if b is not None and b[f] > 0]
            entry[f"{f}_ratio"], entry[f"{f}_ratios"] = spread(ratios), ratios
        out.append(entry)
    return out


def _grid_index(spec: AblationSpec, path: str, value) -> int:
    return list(dict(spec.grid)[path]).index(value)


def variant_label(variant: tuple) -> str:
    """A variant as the table and plot name it ("preset=sync, coord.eta=2")."""
    return ", ".join(f"{p}={v}" for p, v in variant) or "(one variant)"


def _fmt(s: dict, scale: float = 1.0, digits: int = 1) -> str:
    if s["n"] == 0:
        return "–"
    med = f"{scale * s['median']:.{digits}f}"
    if s["n"] == 1:
        return med
    return f"{med} ({scale * s['min']:.{digits}f}–{scale * s['max']:.{digits}f})"


def markdown_table(spec: AblationSpec, summary: list[dict], tokens: int) -> str:
    """The comparison as a markdown table: median (min–max) over seeds per figure."""
    ref = variant_label(reference_variant(spec))
    head = ["variant", "seeds", "trained tok/s", "× ref", "generated tok/s", "× ref",
            f"acc @ {tokens:,} tok (%)", "final acc (%)", "staleness mean", "staleness max",
            "trainer idle", "rollout idle", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary:
        cols = [variant_label(e["variant"]), str(e["n"]), _fmt(e["trained_tok_s"]),
                _fmt(e["trained_tok_s_ratio"], digits=2), _fmt(e["generated_tok_s"]),
                _fmt(e["generated_tok_s_ratio"], digits=2), _fmt(e["acc_at_tokens"], 100),
                _fmt(e["final_acc"], 100), _fmt(e["staleness_mean"], digits=2),
                _fmt(e["staleness_max"], digits=0), _fmt(e["trainer_idle_frac"], digits=2),
                _fmt(e["rollout_idle_frac"], digits=2), _fmt(e["wall_s"], digits=0)]
        lines.append("| " + " | ".join(cols) + " |")
    return ("\n".join(lines) + f"\n\nEach cell: median over seeds (min–max); × ref: the "
            f"median (min–max) over rounds of the ratio to {ref} in the same round.\n")


def csv_text(summary: list[dict]) -> str:
    """One CSV row per variant: its axis values, then median/min/max/n per figure."""
    paths = list(dict.fromkeys(p for e in summary for p, _ in e["variant"]))
    figures = [*FIGURES, *(f"{f}_ratio" for f in RATIO_FIGURES)]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*paths, "n", *(f"{f}_{k}" for f in figures for k in ("median", "min", "max"))])
    for e in summary:
        values = dict(e["variant"])
        w.writerow([*(values.get(p, "") for p in paths), e["n"],
                    *(e[f][k] for f in figures for k in ("median", "min", "max"))])
    return buf.getvalue()


def cells_csv_text(rows: list[dict]) -> str:
    """One CSV row per finished cell with its raw figures."""
    paths = list(dict.fromkeys(p for r in rows for p in r["values"]))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["cell", "round", *paths, *FIGURES, "acc_tokens", *COUNTS])
    for r in rows:
        w.writerow([r["cell"], r["round"], *(r["values"].get(p, "") for p in paths),
                    *(r[f] for f in FIGURES), r["acc_tokens"], *(r[k] for k in COUNTS)])
    return buf.getvalue()


def plot(spec: AblationSpec, rows: list[dict], summary: list[dict], tokens: int,
         path: Path) -> Path:
    """Five panels (trained tok/s, its ratio to the reference in the same round,
    generated tok/s, accuracy at equal trained tokens, staleness): a bar at each
    variant's median, a dot per seed (per round for the ratio)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = variant_label(reference_variant(spec)).removeprefix("preset=")
    panels = (("trained_tok_s", "trained tokens / s", 1.0),
              ("trained_tok_s_ratio", f"trained tokens / s\n÷ {ref}'s in the same round", 1.0),
              ("generated_tok_s", "generated tokens / s", 1.0),
              ("acc_at_tokens", f"held-out accuracy (%)\nat {tokens:,} trained tokens", 100.0),
              ("staleness_mean", "mean staleness\nof trained tokens", 1.0))
    # One axis besides the seed: its values alone name the variants.
    labels = [", ".join(str(v) for _, v in e["variant"]) if len(e["variant"]) == 1
              else variant_label(e["variant"]) for e in summary]
    cols = 3
    rows_n = -(-len(panels) // cols)
    width = max(4.0, 0.55 * len(labels) + 1.5)
    fig, axes = plt.subplots(rows_n, cols, figsize=(width * cols, 3.8 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, title, scale) in zip(axes.flat, panels):
        xs = np.arange(len(summary))
        ax.bar(xs, [scale * e[key]["median"] for e in summary], color="tab:blue", alpha=0.5)
        for x, e in zip(xs, summary):
            ys = ([scale * v for v in e["trained_tok_s_ratios"]] if key.endswith("_ratio") else
                  [scale * r[key] for r in rows if r["variant_name"] == e["variant_name"]])
            ax.plot(np.full(len(ys), x), ys, "k.", ms=6)
        ax.set_xticks(xs, labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"ablation {spec.name}: bars = median over seeds, dots = seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(spec: AblationSpec, cells: list[Cell]) -> list[Path]:
    """ablation.md, ablation.csv, cells.csv and ablation.png of the finished cells under
    the ablation's output directory (nothing but a note when none has finished)."""
    out = spec.out_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(spec, cells)
    if not rows:
        (out / "ablation.md").write_text(f"# ablation {spec.name}\n\nNo cell has finished.\n")
        return [out / "ablation.md"]
    summary = summarize(spec, rows)
    tokens = rows[0]["acc_tokens"]
    pending = len(cells) - len(rows)
    (out / "ablation.md").write_text(
        f"# ablation {spec.name}\n\n{len(rows)} of {len(cells)} cells finished"
        + (f" ({pending} pending)" if pending else "") + ".\n\n"
        + markdown_table(spec, summary, tokens))
    (out / "ablation.csv").write_text(csv_text(summary))
    (out / "cells.csv").write_text(cells_csv_text(rows))
    paths = [out / "ablation.md", out / "ablation.csv", out / "cells.csv"]
    return paths + [plot(spec, rows, summary, tokens, out / "ablation.png")]
