"""Run-directory outputs: metrics.jsonl, TensorBoard events, and PNG plots."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fnrl.shell.files import no_space
from fnrl.shell.records import append, read_skipping


class MetricsWriter:
    """Appends one JSON line per record and mirrors scalars to TensorBoard.

    TensorBoard events are written in the caller's thread (tensorboardX's EventsWriter,
    flushed per record) rather than by SummaryWriter's background thread: that thread
    dies silently on a full disk, and the next writes then block or fail far from the
    cause. Here a full disk raises OSError at the write that met it."""

    def __init__(self, run_dir: Path):
        from tensorboardX.event_file_writer import EventsWriter

        self.run_dir = run_dir
        self._jsonl = append(run_dir / "metrics.jsonl")
        (run_dir / "tensorboard").mkdir(exist_ok=True)
        self._tb = EventsWriter(str(run_dir / "tensorboard" / "events"))

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        from tensorboardX import summary
        from tensorboardX.proto.event_pb2 import Event

        record = {"kind": kind, "step": step, **values}
        self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        now = time.time()
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                point = summary.scalar(f"{kind}/{key}", value)
            elif key == "staleness_hist" and isinstance(value, list) and value:
                # One bin per staleness value (they are whole versions).
                point = summary.histogram(f"{kind}/staleness",
                                          np.repeat(np.arange(len(value)), value),
                                          np.arange(len(value) + 1) - 0.5)
            else:
                continue
            self._tb.write_event(Event(wall_time=now, step=step, summary=point))
        self._tb.flush()

    def close(self) -> None:
        for closing in (self._jsonl.close, self._tb.close):
            try:
                closing()
            except OSError as err:   # a full disk: what was written is kept, the stop goes on
                if not no_space(err):
                    raise


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def staleness_histogram(records) -> np.ndarray:
    """Trained tokens by staleness (trainer version − token version), summed over the
    step records' `staleness_hist`."""
    hist = np.zeros(1)
    for r in records:
        h = np.asarray(r.get("staleness_hist", [0]), float)
        hist = np.pad(hist, (0, max(0, len(h) - len(hist))))
        hist[: len(h)] += h
    return hist


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSON-lines log, framed (fnrl.shell.records) or plain;
    [] when there is no such file. A torn last line is dropped; a damaged line in the
    middle is skipped and said on stderr with its byte offset (these are report logs:
    what resumes depend on is read strictly, by fnrl.control.journal)."""
    records, damaged = read_skipping(path)
    if damaged:
        at, why = damaged[0]
        print(f"fnrl: {path}: {len(damaged)} damaged record(s) skipped (the first at byte "
              f"{at}: {why}); the figures read from this file leave them out",
              file=sys.stderr, flush=True)
    return records


def generated_length(trajectory: dict) -> int:
    """A trajectory record's generated tokens over all its segments (trajectories.jsonl)."""
    return sum(n for _, n in trajectory["segments"])


def response_lengths(run_dir: Path) -> np.ndarray:
    """The generated length (tokens, every segment) of each trained trajectory, from
    trajectories.jsonl (one line per consumed group); empty if the run trained none."""
    path = run_dir / "trajectories.jsonl"
    if not path.exists():
        return np.zeros(0, np.int64)
    return np.array([generated_length(t) for group in read_jsonl(path)
                     for t in group["trajectories"]], np.int64)


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """Median, p99, their ratio (the tail's weight) and mean of response lengths."""
    if lengths.size == 0:
        return {}
    median, p99 = float(np.median(lengths)), float(np.percentile(lengths, 99))
    return {"response_len_median": median, "response_len_p99": p99,
            "response_len_p99_over_median": p99 / max(median, 1.0),
            "response_len_mean": float(lengths.mean()), "responses": int(lengths.size)}


def _plot_router(ax, train: list[dict]) -> None:
    """A mixture of experts' train/inference mismatch KL beside its router: how often
    the trainer's own top-k differs from the replayed routes, and the balance loss."""
    steps = [r["step"] for r in train]
    ax.plot(steps, [r.get("mismatch/kl_k3", np.nan) for r in train], lw=1,
            label="mismatch KL (k3)")
    ax.set(title="MoE: mismatch and routing", xlabel="step", ylabel="KL")
    twin = ax.twinx()
    twin.plot(steps, [r["router/route_disagreement"] for r in train], color="tab:red", lw=1,
              label="routes the trainer would not pick")
    twin.plot(steps, [r["router/aux_loss"] for r in train], color="tab:purple", lw=1,
              ls="--", label="load-balancing loss (top-k when balanced)")
    twin.set(ylabel="fraction; loss")
    ax.legend(fontsize=8, loc="upper left")
    twin.legend(fontsize=8, loc="upper right")


def plot_run(run_dir: Path) -> Path:
    """Reward, held-out accuracy, staleness and response-length plots from metrics.jsonl
    and trajectories.jsonl into curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(run_dir / "metrics.jsonl")
    # (A step trained while no controller ran has a record without the step's metrics.)
    train = [r for r in records if r["kind"] == "train" and "reward_mean" in r]
    evals = [r for r in records if r["kind"] == "eval"]
    routed = [r for r in train if "router/aux_loss" in r]   # a mixture of experts
    fig, axes = plt.subplots(1, 5 if routed else 4, figsize=(25 if routed else 20, 4))
    if train:
        axes[0].plot([r["step"] for r in train], [r["reward_mean"] for r in train], lw=1)
    episodes = [r for r in train if "turns_mean" in r]
    if episodes:   # multi-turn runs: tool use beside the reward it buys
        twin = axes[0].twinx()
        twin.plot([r["step"] for r in episodes], [r["turns_mean"] for r in episodes],
                  color="tab:green", lw=1, label="sampled turns / trajectory")
        twin.plot([r["step"] for r in episodes], [r["tool_success_rate"] for r in episodes],
                  color="tab:orange", lw=1, label="tool-call success rate")
        twin.set(ylabel="turns; success rate")
        twin.legend(fontsize=8, loc="lower right")
    axes[0].set(title="training reward (batch mean)", xlabel="step", ylabel="reward")
    if evals:
        axes[1].plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], "o-")
    axes[1].set(title="held-out accuracy (greedy)", xlabel="policy version", ylabel="%")
    hist = staleness_histogram(train)
    axes[2].bar(np.arange(len(hist)), hist)
    axes[2].set(title="staleness of trained tokens", xlabel="trainer version − token version",
                ylabel="tokens")
    lengths = response_lengths(run_dir)
    stats = length_stats(lengths)
    if stats:
        axes[3].hist(lengths, bins=min(60, max(1, int(lengths.max()))), color="tab:gray")
        for key, style in (("response_len_median", "-"), ("response_len_p99", "--")):
            axes[3].axvline(stats[key], color="tab:red", ls=style,
                            label=f"{key.rsplit('_', 1)[1]} {stats[key]:.0f}")
        axes[3].legend(fontsize=8)
    axes[3].set(title="response lengths"
                + (f" (p99/median {stats['response_len_p99_over_median']:.1f})" if stats else ""),
                xlabel="generated tokens per trained trajectory", ylabel="trajectories")
    if routed:
        _plot_router(axes[4], routed)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_timeline(run_dir: Path) -> Path | None:
    """Running trajectories per rollout and trainer / pull intervals over time, from
    timeline.json, into timeline.png (None if the run wrote no timeline)."""
    path = run_dir / "timeline.json"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = json.loads(path.read_text())
    samples = [x for x in items if "running" in x]
    events = [x for x in items if "event" in x]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    if samples:
        t = np.array([x["t"] for x in samples])
        running = np.array([x["running"] for x in samples])
        for r in range(running.shape[1]):
            top.step(t, running[:, r], where="post", lw=1, label=f"rollout {r}")
        top.legend(loc="upper right", fontsize=8)
    top.set(title="trajectories placed per rollout", ylabel="trajectories")
    work = [e for e in events if e["event"] in ("train", "pull")]
    # Role outages (fault, detection, restart), drawn on the lane of the role.
    outages = [e for e in events if e["event"] == "fault:recovered"
               and (e["role"] == "trainer" or e["role"].startswith("rollout"))]
    rids = [e["rid"] for e in work if "rid" in e] + \
        [int(e["role"].removeprefix("rollout")) for e in outages if e["role"] != "trainer"]
    lanes = 1 + max(rids + [-1]) + 1
    for e in work:
        lane = 0 if e["event"] == "train" else 1 + e["rid"]
        color = "tab:red" if e["event"] == "train" else "tab:blue"
        bottom.barh(lane, e["t"] - e["t0"], left=e["t0"], color=color, height=0.6)
        if e["event"] == "train":
            bottom.text(e["t0"], lane, f"v{e['version']}", fontsize=6, va="center")
    for e in outages:
        lane = 0 if e["role"] == "trainer" else 1 + int(e["role"].removeprefix("rollout"))
        bottom.barh(lane, e["down_s"], left=e["t"] - e["down_s"], color="0.3", hatch="//",
                    height=0.6, alpha=0.6)
    bottom.set_yticks(range(lanes), ["train"] + [f"rollout {r}" for r in range(lanes - 1)])
    bottom.set(xlabel="seconds since the first cycle",
               title="train steps (red), pulls (blue), role down after a fault (grey)")
    fig.tight_layout()
    out = run_dir / "timeline.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
