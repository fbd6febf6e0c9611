"""What the controller reports: per-step records, utilization and the run's summary,
with the same keys under every preset so ablations compare key for key."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fnrl.control.loop import Controller


def utilization(ctl: "Controller") -> dict:
    """Idle ratios and KV use since the loop started; the same keys for every preset.
    Evaluation time is not counted (it is not RL work)."""
    b = ctl.book
    wall = max(time.perf_counter() - ctl._t0 - b.time["eval_s"], 1e-9)
    active = np.array([r.active_s for r in ctl.rollouts])
    kv = np.array([r.kv_token_s / max(r.kv_capacity, 1.0) for r in ctl.rollouts])
    return {"wall_s": wall, "trainer_idle_frac": 1.0 - b.time["train_call_s"] / wall,
            "rollout_idle_frac": float(np.mean(1.0 - np.minimum(active / wall, 1.0))),
            "kv_util": float(np.mean(kv / wall)),
            "trained_tokens_total": b.trained_tokens,
            "trained_tokens_per_s_cum": b.trained_tokens / wall}

def log_step(ctl: "Controller", trainer_metrics: dict, stats: dict) -> None:
    """One metrics.jsonl record per train step, and the progress bar."""
    b = ctl.book
    now = time.perf_counter()
    record = {**{k: v for k, v in trainer_metrics.items()}, **stats,
              "preset": ctl.cfg.preset or "custom",
              "trained_tokens_per_s": stats["tokens"] / max(now - ctl._last_step_t, 1e-9),
              "generated_tokens": b.generated_tokens,
              "invalid_trajectories": b.invalid_trajectories,
              **{f"time/{k}": v for k, v in b.time.items()},
              **{k: b.counts[k] for k in COUNT_KEYS},
              **utilization(ctl),
              "rollout_versions": [r.version for r in ctl.rollouts]}
    ctl._last_step_t = now
    ctl.writer.write("train", b.trainer_version, record)
    acc = b.last_eval["accuracy"] if b.last_eval else float("nan")
    ctl._bar.set_postfix(reward=f"{stats['reward_mean']:.2f}", acc=f"{100 * acc:.0f}%",
                          stale=f"{stats['staleness_mean']:.2f}")
    ctl._bar.update(1)

def summary(ctl: "Controller", wall: float) -> dict:
    """The run's summary.json (ETTR and recovery times from the supervisor)."""
    b = ctl.book
    # RL time: from the first cycle to the last step's return, evaluations excluded.
    train_wall = max(ctl._last_train_end - ctl._t0 - ctl._eval_s_in_loop, 1e-9)
    return {"steps": b.steps_done, "version": b.trainer_version, "last_eval": b.last_eval,
            **ctl.supervisor.ettr(wall),
            "invalid_trajectories": b.invalid_trajectories, "wall_s": wall,
            "train_wall_s": train_wall, "trained_tokens": b.trained_tokens,
            "trained_tokens_per_s": b.trained_tokens / train_wall,
            "generated_tokens": b.generated_tokens,
            **{k: b.counts[k] for k in COUNT_KEYS}, **utilization(ctl)}


# Counters every preset reports, so runs compare key for key.
COUNT_KEYS = ("routed", "interrupted", "continued", "migrated", "repacks", "reprefill_tokens",
          "pulls", "aborted", "dropped_groups", "consumed_groups", "speculative_resets",
          "dynamic_sampling_dropped", "unfinished_at_end",
          "fault_interrupted", "train_retries", "steps_recovered_from_checkpoint",
          "pulls_skipped_down", "evals_lost", "recovered_groups",
          "recovered_trajectories", "recovery_discarded_tokens", "reward_errors",
          "pull_retries")
