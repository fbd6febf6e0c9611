"""Run-directory outputs: metrics.jsonl, TensorBoard events, and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np


class MetricsWriter:
    """Appends one JSON line per record and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        self.run_dir = run_dir
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": step, **values}
        self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._tb.add_scalar(f"{kind}/{key}", value, step)
            elif key == "staleness_hist" and isinstance(value, list) and value:
                self._tb.add_histogram(f"{kind}/staleness", np.repeat(np.arange(len(value)), value), step)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path) -> Path:
    """Reward, held-out accuracy and staleness plots from metrics.jsonl into curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        axes[0].plot([r["step"] for r in train], [r["reward_mean"] for r in train], lw=1)
    axes[0].set(title="training reward (batch mean)", xlabel="step", ylabel="reward")
    if evals:
        axes[1].plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], "o-")
    axes[1].set(title="held-out accuracy (greedy)", xlabel="policy version", ylabel="%")
    hist = np.zeros(1)
    for r in train:
        h = np.asarray(r.get("staleness_hist", [0]), float)
        hist = np.pad(hist, (0, max(0, len(h) - len(hist))))
        hist[: len(h)] += h
    axes[2].bar(np.arange(len(hist)), hist)
    axes[2].set(title="staleness of trained tokens", xlabel="trainer version − token version",
                ylabel="tokens")
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
