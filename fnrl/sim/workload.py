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


RESPONSES = ("lognormal", "fixed", "job_lognormal", "job_pareto", "recorded")


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    groups_per_step: int = 128
    """Groups (prompts) per training step."""
    group_size: int = 16
    prompt_len: int = 1024
    response: str = "lognormal"
    """"lognormal" (median, sigma, clipped at len_max), "fixed" (every response
    len_median), or "job_lognormal" / "job_pareto": the real job's forced lengths
    (fnrl.control.workload.forced_length, drawn per trajectory id), for replays; or
    "recorded": a real run's own lengths (`recorded`)."""
    len_median: int = 4096
    len_sigma: float = 1.0
    len_max: int = 20480
    group_corr: float = 0.0
    """Share of the log-length variance common to a group's members (0: independent)."""
    recorded: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """"recorded": the response lengths of real runs, one tuple of groups per run. The
    simulation seed picks the run (seed mod runs), and group `gid` is that run's group
    `gid`; a group the run did not record (generated, never consumed) is one of its
    groups, drawn from (seed, gid)."""
    len_growth: float = 0.0
    """The median grows linearly by this fraction over the run's groups (1.0: doubles)."""
    turns: int = 1
    """Decode turns per trajectory (1: single-turn). Between two turns the trajectory
    makes a tool call: it stops decoding for the call's latency, then its engine resumes
    it, prefilling the tool's observation. Its response tokens are split evenly over the
    turns (`turn_ends`)."""
    tool_latency_s: float = 0.0
    """Median latency of one tool call."""
    tool_latency_sigma: float = 0.0
    """σ of the log-latency (0: every call takes tool_latency_s)."""
    tool_tokens: int = 0
    """Observation tokens a tool call appends to the context (prefilled, not generated)."""
    tool_holds_kv: bool = True
    """During a call the trajectory keeps its KV blocks (resumed with only the observation
    to prefill), or releases them (the prefix cache may still hold them when it resumes)."""

    def __post_init__(self):
        for name in ("groups_per_step", "group_size", "prompt_len", "len_median", "len_max"):
            check(getattr(self, name) > 0, "WorkloadSpec", name, getattr(self, name), "must be > 0")
        check(self.response in RESPONSES, "WorkloadSpec", "response", self.response,
              f"must be one of {RESPONSES}")
        check(self.len_sigma >= 0, "WorkloadSpec", "len_sigma", self.len_sigma, "must be >= 0")
        check(0 <= self.group_corr <= 1, "WorkloadSpec", "group_corr", self.group_corr,
              "must be in [0, 1]")
        check(self.len_growth >= 0, "WorkloadSpec", "len_growth", self.len_growth, "must be >= 0")
        if self.response == "recorded":
            check(bool(self.recorded) and all(self.recorded), "WorkloadSpec", "recorded",
                  len(self.recorded), "must hold at least one run of at least one group")
            check(all(len(g) == self.group_size for run in self.recorded for g in run),
                  "WorkloadSpec", "recorded", "groups",
                  f"every recorded group must have group_size={self.group_size} members")
        check(self.turns >= 1, "WorkloadSpec", "turns", self.turns, "must be >= 1")
        for name in ("tool_latency_s", "tool_latency_sigma", "tool_tokens"):
            check(getattr(self, name) >= 0, "WorkloadSpec", name, getattr(self, name), "must be >= 0")


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
    if spec.response == "recorded":
        run = spec.recorded[seed % len(spec.recorded)]
        pick = gid if gid < len(run) else int(np.random.default_rng([seed, gid]).integers(len(run)))
        return np.asarray(run[pick], np.int64)
    if spec.response == "fixed":
        return np.full(spec.group_size, min(int(round(median)), spec.len_max), np.int64)
    rng = np.random.default_rng([seed, gid])
    z = rng.standard_normal(spec.group_size + 1)
    rho = spec.group_corr
    mixed = np.sqrt(rho) * z[0] + np.sqrt(1.0 - rho) * z[1:]
    lengths = np.rint(median * np.exp(spec.len_sigma * mixed))
    return np.clip(lengths, 1, spec.len_max).astype(np.int64)


def turn_ends(target: int, turns: int) -> list[int]:
    """Generated-token counts at which a response of `target` tokens ends each of its
    turns (the last is `target`): the turns split it as evenly as whole tokens allow,
    and a turn has at least one token (fewer turns when the response is shorter)."""
    return sorted({-(-k * target // turns) for k in range(1, turns + 1)} - {0})


def tool_latency(spec: WorkloadSpec, seed: int, tid: int, call: int) -> float:
    """Latency of trajectory `tid`'s call number `call`, lognormal around the median,
    drawn from (seed, tid, call) so every preset sees the same calls."""
    if spec.tool_latency_sigma == 0:
        return spec.tool_latency_s
    z = np.random.default_rng([seed, tid, call, 7]).standard_normal()
    return float(spec.tool_latency_s * np.exp(spec.tool_latency_sigma * z))


# Named workloads for a what-if (`python -m fnrl.sim --workload-preset NAME`; any field
# still set by its flag). Lengths are in tokens. The figures are stated assumptions or
# taken from the source named beside them; none is a measurement of ours.
WORKLOAD_PRESETS: dict[str, WorkloadSpec] = {
    # Short chain-of-thought answers to grade-school maths. verl's GRPO GSM8K example
    # (examples/grpo_trainer/run_qwen2-7b.sh) caps prompts at 512 and responses at 1,024
    # tokens with 5 samples a prompt; a median answer of ~300 tokens with a narrow spread
    # (σ = 0.5) is assumed, 256 groups of 8 a step assumed.
    "gsm8k": WorkloadSpec(groups_per_step=256, group_size=8, prompt_len=256, len_median=300,
                          len_sigma=0.5, len_max=1024),
    # Long reasoning with heavy tails: DAPO's setup (Yu et al. 2025, §4: 512 prompts of 16
    # responses, at most 20,480 response tokens) at a quarter of its batch; the median
    # (4K, σ = 1) is the seeds' (StaleFlow Fig. 4, Laminar Fig. 17), groups half-correlated
    # (StaleFlow App. C: groups are all-long or all-short; 0.5 assumed), and lengths
    # growing by half over the run (every seed's lengths rise; 0.5 assumed).
    "math-long": WorkloadSpec(groups_per_step=128, group_size=16, prompt_len=1024,
                              len_median=4096, len_sigma=1.0, len_max=20480, group_corr=0.5,
                              len_growth=0.5),
    # Multi-turn tool use (agentic): all assumed. A long prompt (system prompt and tool
    # schemas, 2K), 4 decode turns of ~256 tokens each with a tool call between two turns
    # (median 2 s, lognormal σ = 1: a sandboxed command or a web request), each call
    # appending 512 observation tokens, KV held during the call.
    "agentic": WorkloadSpec(groups_per_step=64, group_size=8, prompt_len=2048,
                            len_median=1024, len_sigma=0.7, len_max=8192, turns=4,
                            tool_latency_s=2.0, tool_latency_sigma=1.0, tool_tokens=512),
}


def workload_preset(name: str) -> WorkloadSpec:
    """The named workload of WORKLOAD_PRESETS."""
    if name not in WORKLOAD_PRESETS:
        raise ValueError(f"invalid config workload_preset={name!r}: must be one of "
                         f"{sorted(WORKLOAD_PRESETS)}")
    return WORKLOAD_PRESETS[name]
