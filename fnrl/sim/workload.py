"""Simulated workloads: prompt and response lengths of each group.

Responses are long-tailed like the seeds' (StaleFlow Fig. 4, Laminar Fig. 17, OrchestrRL
Fig. 3): lognormal around a median, clipped at the maximum, optionally correlated within
a group (StaleFlow App. C: "groups tend to be all-long or all-short"), and growing over
training (every seed's lengths rise as the policy learns to reason longer). Lengths are
drawn per group from (seed, gid), so every preset sees the same workload group by group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fnrl.config import RolloutConfig
from fnrl.config.base import check
from fnrl.control.workload import forced_length


RESPONSES = ("lognormal", "fixed", "job_lognormal", "job_pareto")


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    groups_per_step: int = 128
    """Groups (prompts) per training step."""
    group_size: int = 16
    prompt_len: int = 1024
    response: str = "lognormal"
    """"lognormal" (median, sigma, clipped at len_max), "fixed" (every response
    len_median), or "job_lognormal" / "job_pareto": the real job's forced lengths
    (fnrl.control.workload.forced_length, drawn per trajectory id), for replays."""
    len_median: int = 4096
    len_sigma: float = 1.0
    len_max: int = 20480
    group_corr: float = 0.0
    """Share of the log-length variance common to a group's members (0: independent)."""
    len_growth: float = 0.0
    """The median grows linearly by this fraction over the run's groups (1.0: doubles)."""

    def __post_init__(self):
        for name in ("groups_per_step", "group_size", "prompt_len", "len_median", "len_max"):
            check(getattr(self, name) > 0, "WorkloadSpec", name, getattr(self, name), "must be > 0")
        check(self.response in RESPONSES, "WorkloadSpec", "response", self.response,
              f"must be one of {RESPONSES}")
        check(self.len_sigma >= 0, "WorkloadSpec", "len_sigma", self.len_sigma, "must be >= 0")
        check(0 <= self.group_corr <= 1, "WorkloadSpec", "group_corr", self.group_corr,
              "must be in [0, 1]")
        check(self.len_growth >= 0, "WorkloadSpec", "len_growth", self.len_growth, "must be >= 0")


def group_lengths(spec: WorkloadSpec, seed: int, gid: int, progress: float) -> np.ndarray:
    """Response lengths of group `gid`'s members; `progress` in [0, 1] is how far the run
    is (by groups issued), which scales the median by 1 + len_growth·progress."""
    median = spec.len_median * (1.0 + spec.len_growth * min(max(progress, 0.0), 1.0))
    if spec.response.startswith("job_"):
        # Trajectory ids are dense in arrival order, a group's members together.
        rollout = RolloutConfig(response_len=spec.response.removeprefix("job_"),
                                len_median=float(median), len_sigma=spec.len_sigma,
                                len_max=spec.len_max)
        base = gid * spec.group_size
        return np.array([forced_length(rollout, seed, base + k) for k in range(spec.group_size)],
                        np.int64)
    if spec.response == "fixed":
        return np.full(spec.group_size, min(int(round(median)), spec.len_max), np.int64)
    rng = np.random.default_rng([seed, gid])
    z = rng.standard_normal(spec.group_size + 1)
    rho = spec.group_corr
    mixed = np.sqrt(rho) * z[0] + np.sqrt(1.0 - rho) * z[1:]
    lengths = np.rint(median * np.exp(spec.len_sigma * mixed))
    return np.clip(lengths, 1, spec.len_max).astype(np.int64)
