"""The simulated run's summary (summary.json): the real job's keys from
`fnrl.control.report`, the seeds' throughput and the simulator's own counters."""

from __future__ import annotations

import dataclasses

import numpy as np

from fnrl.control import report
from fnrl.sim.layout import steady_throughput


def summarize(sim) -> dict:
    """The run's summary.json: the loop's counts and shares, and the simulator's own."""
    b, wall = sim.book, sim.now
    train_wall = max(b.last_train_end_s, 1e-9)
    # The steady step: between the first and the last step's end (a pipeline's first
    # step also waits for its first batch).
    ends = [t for v, t in sorted(sim.published.items()) if v >= 1]
    step_s = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else train_wall
    # Shares of the rollout GPUs' time: with rollout_modes every mode's instances span
    # the same GPUs (a mode that is down is not idle GPUs); otherwise per-rollout means.
    gpus_R = len(sim.lay.modes[0].rids) * sim.lay.modes[0].tp

    def idle(seconds) -> float:
        busy = np.minimum(np.asarray(seconds) / max(wall, 1e-9), 1.0)
        return float(1.0 - busy @ sim.tp_R / gpus_R)
    lat = sim.trajs.latencies()
    return {"preset": sim.cfg.preset, "gpus": sim.cfg.gpus, "steps": b.steps_done,
            "train_wall_s": train_wall, "trained_tokens_per_s": b.trained_tokens / train_wall,
            "trained_seq_tokens": sim.seq_tokens,
            "trained_seq_tokens_per_s": sim.seq_tokens / train_wall,
            "steady_seq_tokens_per_s": steady_throughput(sim.step_records, sim.cfg.warmup_steps),
            "version": b.trainer_version, "trained_tokens": b.trained_tokens,
            "step_s": step_s,
            "generated_tokens": b.generated_tokens, "staleness_checked_tokens": b.checked_tokens,
            "staleness_checked_max": b.max_staleness, "eta": sim.eta,
            **{k: b.counts[k] for k in report.COUNT_KEYS},
            **report.utilization(b, sim.inst, wall),
            "rollout_idle_frac": idle([i.active_s for i in sim.inst]),
            "rollout_decode_idle_frac": idle([i.busy_s for i in sim.inst]),
            "preemptions": sum(i.preemptions for i in sim.inst),
            "engine_command_s": sum(i.command_s for i in sim.inst),
            "engine_prefill_tokens": sum(i.prefill_tokens for i in sim.inst),
            "train_gpus": sim.lay.train_gpus, "rollouts": sim.lay.rollouts,
            "rollout_gpus": gpus_R, "reconfigures": sim.stats["reconfigures"],
            "mode_tp": sim.mode.tp,
            "kv_capacity_tokens": sim.lay.kv_capacity, "publish_s": sim.lay.publish_s,
            "pull_s": sim.lay.pull_s, "cost_model": dataclasses.asdict(sim.lay.decode.cost),
            "trajectories": sim.trajs.n, "tool_calls": sim.stats["tool_calls"],
            "traj_latency_mean_s": float(lat.mean()) if lat.size else 0.0,
            "traj_latency_p50_s": float(np.median(lat)) if lat.size else 0.0,
            "traj_latency_max_s": float(lat.max()) if lat.size else 0.0,
            "sim_events": sim.stats["events"], "sim_cycles": sim.stats["cycles"],
            "sim_decide_s": sim.stats["decide_s"],
            "sim_invalid_cycles": sim.stats["invalid_cycles"],
            "sim_decide_cpu_s": sim.stats["decide_cpu_s"], "sim_cpu_s": sim.stats["cpu_s"],
            "sim_wall_s": sim.stats["wall_s"]}
