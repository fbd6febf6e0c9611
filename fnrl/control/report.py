"""What the controller reports: per-step records, utilization, the effective training
time ratio, and the run's summary over every attempt, with the same keys under every
preset so ablations compare key for key.

A run may take several attempts: the job runner restarts every role after an
escalated failure, and a controller that was killed is re-run on the same run
directory. Each attempt appends its start, its progress (every step, and every few
seconds) and its end to attempts.jsonl, so the summary covers all of them; counts the
summary reports are read back from the run's own logs (metrics.jsonl, faults.jsonl,
trajectories.jsonl), not from the last controller's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fnrl.control.book import Book
from fnrl.control.metrics import read_jsonl
from fnrl.shell.files import DiskFull, SpaceReserve, no_space
from fnrl.shell.records import append, frame
from fnrl.types import Abort, DropGroups, Interrupt, Migrate, Route

# Counters every preset reports, so runs compare key for key.
# migrated: trajectories moved between rollouts; migrations: Migrate commands, of which
# repacks are Laminar's consolidations (fnrl.policy.repack), the rest balancing moves.
COUNT_KEYS = ("routed", "interrupted", "continued", "migrated", "migrations", "repacks",
              "reprefill_tokens",
              "pulls", "aborted", "dropped_groups", "consumed_groups", "speculative_resets",
              "dynamic_sampling_dropped", "unfinished_at_end", "skipped_updates", "refused_updates",
              "fault_interrupted", "train_retries", "steps_recovered_from_checkpoint",
              "pulls_skipped_down", "evals_lost", "evals_skipped", "recovered_groups",
              "recovered_trajectories", "recovery_discarded_tokens", "reward_errors",
              "pull_retries", "episodes_resumed", "episodes_restarted", "env_errors",
              "env_failed_groups", "recovery_pool_torn_bytes", "recovery_pool_damaged_bytes",
              "recovery_pool_discarded_trajectories", "recovery_pool_discarded_tokens")


def count_command(counts, cmd) -> None:
    """Counts one placement command as the loop and the simulator both do: routed,
    interrupted, migrated (with migrations and repacks by reason), aborted trajectories
    and dropped groups. Pulls are counted where they land (one may be skipped)."""
    if isinstance(cmd, Route):
        counts["routed"] += len(cmd.tids)
    elif isinstance(cmd, Interrupt):
        counts["interrupted"] += len(cmd.tids)
    elif isinstance(cmd, Migrate):
        counts["migrated"] += len(cmd.tids)
        counts["migrations"] += 1
        counts["repacks"] += cmd.reason == "repack"
    elif isinstance(cmd, Abort):
        counts["aborted"] += len(cmd.tids)
    elif isinstance(cmd, DropGroups):
        counts["dropped_groups"] += len(cmd.gids)


def account_rollouts(rollouts: Sequence, snap, dt: float, *, trainer_down: bool) -> np.ndarray:
    """Adds the `dt` seconds since the last snapshot to each rollout's active, blocked
    (idle while the trainer is down) and KV-token time; returns the running count per
    rollout."""
    placed = np.bincount(snap.traj_inst_N[snap.traj_inst_N >= 0], minlength=len(rollouts))
    for r, state in enumerate(rollouts):
        state.active_s += dt * bool(placed[r])
        state.blocked_s += dt * (trainer_down and not placed[r])
        state.kv_token_s += dt * float(snap.inst_kv_used_R[r])
        state.kv_prev = float(snap.inst_kv_used_R[r])
    return placed


def utilization(book: Book, rollouts: Sequence, wall_s: float) -> dict:
    """Idle ratios and KV use over the loop's RL time (its wall time less evaluations).

    The trainer's idle share is over the whole wall time: held-out evaluation runs on a
    rollout beside training, so train calls go on during it (over RL time alone the
    share went negative whenever the trainer was the bottleneck)."""
    rl_wall = max(wall_s - book.time["eval_s"], 1e-9)
    active = np.array([r.active_s for r in rollouts])
    kv = np.array([r.kv_token_s / max(r.kv_capacity, 1.0) for r in rollouts])
    trainer_busy = min(book.time["train_call_s"] / max(wall_s, 1e-9), 1.0)
    return {"rl_wall_s": rl_wall, "trainer_idle_frac": 1.0 - trainer_busy,
            "rollout_idle_frac": float(np.mean(1.0 - np.minimum(active / rl_wall, 1.0))),
            "kv_util": float(np.mean(kv / rl_wall)),
            "trained_tokens_total": book.trained_tokens,
            "trained_tokens_per_s_cum": book.trained_tokens / rl_wall}


def ettr(outages: Sequence, rollouts: Sequence, *, num_relays: int, wall_s: float) -> dict:
    """RobustRL's effective training time ratio over one attempt: 1 − (role-seconds not
    doing useful work) / (role-seconds in all). Units are the trainer, every rollout and
    every relay. A role is not useful from its failure (or injected kill) until it is
    back (a relay: until its replacement serves, or to the end if none does), and a rollout is not useful while it has nothing to do because the trainer is
    down. Gap: the paper weights slices by the share of useful roles without a formula
    (digest §5.1); counting relays as units and idle-by-outage rollouts as down is ours."""
    units = 1 + len(rollouts) + num_relays
    spans = [(o.role, o.start_s, o.ready_s if o.ready_s is not None else wall_s, o)
             for o in outages]
    down = sum(max(0.0, min(end, wall_s) - max(start, 0.0)) for _, start, end, _ in spans)
    blocked = sum(r.blocked_s for r in rollouts)
    by_kind: dict[str, list[float]] = {}
    for role, start, end, o in spans:
        if o.ready_s is not None:
            kind = "trainer" if role == "trainer" else role.rstrip("0123456789")
            by_kind.setdefault(kind, []).append(end - start)
    return {"ettr": 1.0 - (down + blocked) / max(units * wall_s, 1e-9),
            "role_down_s": down + blocked, "rollout_blocked_s": blocked, "ettr_units": units,
            **{f"{k}_recovery_s_mean": float(np.mean(v)) for k, v in by_kind.items()},
            **{f"{k}_recovery_s_max": float(np.max(v)) for k, v in by_kind.items()},
            "recovery_after_detect_s_max": max((o.ready_s - o.detected_s for o in outages
                                                if o.ready_s is not None), default=0.0)}


def step_record(book: Book, rollouts: Sequence, trainer_metrics: dict, stats: dict, *,
                preset: str, wall_s: float, since_last_step_s: float) -> dict:
    """One metrics.jsonl record per train step."""
    return {**trainer_metrics, **stats, "preset": preset,
            "trained_tokens_per_s": stats["tokens"] / max(since_last_step_s, 1e-9),
            "generated_tokens": book.generated_tokens,
            "invalid_trajectories": book.invalid_trajectories,
            **{f"time/{k}": v for k, v in book.time.items()},
            **{k: book.counts[k] for k in COUNT_KEYS},
            **utilization(book, rollouts, wall_s), "wall_s": wall_s,
            "rollout_versions": [r.version for r in rollouts]}


class Attempts:
    """attempts.jsonl: one start, progress records and (unless killed) one end per
    attempt, framed (fnrl.shell.records). A killed attempt's last progress record bounds
    when it stopped. It also holds the run's room for a clean stop: a few MiB reserved at
    start (fnrl.shell.files.SpaceReserve), given back when the disk fills so the end
    record and every log's close can still be written."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "attempts.jsonl"
        previous = read_jsonl(self.path)
        self.attempt = 1 + max((r["attempt"] for r in previous), default=-1)
        self._f = append(self.path)
        self.reserve = SpaceReserve(run_dir)
        self.disk_full: DiskFull | None = None

    def write(self, event: str, epoch: float, **fields) -> None:
        self._f.write(frame({"attempt": self.attempt, "event": event, "epoch": epoch,
                             **fields}))

    def stop_on_full_disk(self, err: BaseException, epoch: float, **progress) -> DiskFull:
        """The attempt's end after a write found the disk full: its free bytes read now,
        the reserve given back, an end record of its own (not a killed attempt)."""
        self.disk_full = DiskFull.of(err, "the controller wrote its logs", self.path.parent)
        self.reserve.release()
        self.write("end", epoch, disk_full=str(self.disk_full), **progress)
        return self.disk_full

    def closing(self, action) -> None:
        """Runs a closing `action`; once the disk is full, what it cannot write is let go
        (what was written before is whole: every log tells a torn tail)."""
        try:
            action()
        except OSError as err:
            if self.disk_full is None or not no_space(err):
                raise

    def close(self) -> None:
        self.closing(self._f.close)
        if self.disk_full is None:
            self.reserve.release()


def progress(book: Book, outages: Sequence, rollouts: Sequence, *, num_relays: int,
             wall_s: float) -> dict:
    """An attempt's progress record: enough for ETTR across attempts if it is killed."""
    e = ettr(outages, rollouts, num_relays=num_relays, wall_s=wall_s)
    return {"wall_s": wall_s, "steps": book.steps_done, "role_down_s": e["role_down_s"],
            "ettr_units": e["ettr_units"]}


def attempt_summary(book: Book, rollouts: Sequence, outages: Sequence, *, failures: int,
                    num_relays: int, eta: int, eval_server: str, gates: dict, wall_s: float,
                    eval_in_loop_s: float) -> dict:
    """One attempt's figures; the job runner adds those over every attempt."""
    # RL time: from the first cycle to the last step's return, evaluations excluded.
    train_wall = max(book.last_train_end_s - eval_in_loop_s, 1e-9)
    return {"steps": book.steps_done, "train_wall_s": train_wall,
            "trained_tokens_per_s": book.trained_tokens / train_wall,
            "version": book.trainer_version, "last_eval": book.last_eval,
            **ettr(outages, rollouts, num_relays=num_relays, wall_s=wall_s),
            "failures": failures, "loop_wall_s": wall_s,
            "invalid_trajectories": book.invalid_trajectories,
            "trained_tokens": book.trained_tokens, "generated_tokens": book.generated_tokens,
            "staleness_checked_tokens": book.checked_tokens,
            "staleness_checked_max": book.max_staleness, "eta": eta, "eval_server": eval_server,
            "evaluated_versions": list(book.evaluated_versions),
            "eval_lane_s": book.time["eval_lane_s"], **gates,
            **{k: book.counts[k] for k in COUNT_KEYS},
            **utilization(book, rollouts, wall_s)}


def across_attempts(run_dir: Path) -> dict:
    """ETTR and wall time over every attempt of the run: each attempt's own role down
    time, plus every role down from the end of one attempt (its last record) until the
    next one's loop started (roles restarting, or no controller at all).

    The held-out evaluation an attempt runs before its loop starts is left out of its gap
    and of the wall time: a role restart never pays it, so charging it to a job restart
    alone would compare restart kinds unequally (lab/benchmarks/ettr.py)."""
    records = read_jsonl(run_dir / "attempts.jsonl")
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    starts = {r["attempt"]: r["epoch"] for r in records if r["event"] == "start"}
    evals = {r["attempt"]: r.get("eval_before_s", 0.0) for r in records if r["event"] == "start"}
    last = {r["attempt"]: r for r in records if r["event"] in ("progress", "end")}
    order = sorted(a for a in starts if a in last)
    if not order:
        return {}
    units = last[order[-1]]["ettr_units"]
    gaps = [max(starts[b] - last[a]["epoch"] - evals[b], 0.0) for a, b in zip(order, order[1:])]
    wall = last[order[-1]]["epoch"] - starts[order[0]] - sum(evals[b] for b in order[1:])
    down = sum(last[a]["role_down_s"] for a in order) + units * sum(gaps)
    faults = read_jsonl(run_dir / "faults.jsonl")
    return {"ettr": 1.0 - down / max(units * wall, 1e-9), "attempts": len(order),
            "restart_gaps_s": gaps, "wall_s_all_attempts": wall, "role_down_s_all": down,
            "eval_before_start_s": [evals[a] for a in order],
            "failures": sum(r.get("event") == "failure" for r in faults),
            "killed_attempts": sum(last[a]["event"] != "end" for a in order),
            "consumed_groups_all": len(read_jsonl(run_dir / "trajectories.jsonl")),
            "train_records_all": len(train),
            "refused_updates_all": sum(r.get("gate_refused", 0.0) == 1.0 for r in train)}


REFUSAL_CAUSES = {
    "mismatch_kl": "the trainer's log-probs disagree with the sampler's on the same weights: "
                   "a sampling setting or model difference between trainer and servers "
                   "(dtype, kernels, a tokenizer or chat template that differs), or weights "
                   "that never reached the servers",
    "is_weight": "importance weights far from 1: the trainer's log-probs disagree with the "
                 "sampler's (see mismatch_kl), or the data are staler than the run allows",
    "clip_frac": "most tokens clipped: a learning rate too high, or log-probs that disagree "
                 "with the sampler's",
    "grad_norm": "gradients above the bound on every step: a learning rate too high or a "
                 "bound (--gates.max-grad-norm) too low for this model",
    "nonfinite": "a NaN or Inf loss or gradient on every step: bad rewards or inputs, or an "
                 "unstable loss setting",
}


def learned_nothing(summary: dict) -> str | None:
    """The message of a run whose every update a correctness gate refused (its version
    advanced, its weights never moved), naming the rules that fired and their likely
    cause; None when at least one update was kept."""
    steps = summary.get("train_records_all", summary.get("steps", 0))
    refused = summary.get("refused_updates_all", summary.get("refused_updates", 0))
    if not steps or refused < steps:
        return None
    rules = summary.get("gate_rules") or {}
    named = ", ".join(f"{rule} ({count} firings)" for rule, count in
                      sorted(rules.items(), key=lambda kv: -kv[1])) or "a gate"
    causes = "; ".join(f"{rule}: {REFUSAL_CAUSES[rule]}" for rule in rules
                       if rule in REFUSAL_CAUSES)
    return (f"every one of the run's {steps} updates was refused by the correctness gates "
            f"({named}): the weights never changed. Likely cause: "
            f"{causes or 'see the gate records in metrics.jsonl'}. The figures of each "
            "refusal are in metrics.jsonl (kind gate); --gates.rules chooses the rules")
