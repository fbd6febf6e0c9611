"""Configuration of the rollout coordinator (fnrl.policy): staleness bound, decode cost
model, routing, sync, migration, repack and balancing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import tyro

from fnrl.config.base import check

SYNC_MODES = ("lazy", "greedy", "on_idle", "global")
ROUTING_POLICIES = ("waterfall", "fewest")
SAMPLER_NAMES = ("fifo", "oldest_version", "protocol")
"""The keys of fnrl.policy.samplers.SAMPLERS (a test keeps the two equal)."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-decode-step latency L = k1·kv + max(k2, k3·n) + k4 (StaleFlow App. B Eq. 11).

    kv is the instance's KV cache in tokens and n its running trajectories; k5 is the
    KV footprint of one token (1 when kv is counted in tokens). Defaults: Table 4
    (Qwen3-30B-A3B on H20). Gap (digest gap 8): the paper leaves kv's unit open; with
    k1 = 7.28e-8 s only token counts give plausible latencies, so kv is in tokens and
    k5 = 1. The functions over it are in fnrl.policy.cost_model; refit it for your
    engine with `python -m fnrl.experiments.profile_cost`.
    """

    k1: float = 7.28e-8
    k2: float = 1.72e-3
    k3: float = 1.25e-4
    k4: float = 1.07e-2
    k5: float = 1.0

    def __post_init__(self):
        for name in ("k1", "k2", "k3", "k4"):
            check(getattr(self, name) >= 0, "CostModel", name, getattr(self, name),
                  "must be >= 0")
        check(self.k5 > 0, "CostModel", "k5", self.k5, "must be > 0")
        check(self.k2 + self.k3 + self.k4 > 0, "CostModel", "k2+k3+k4",
              self.k2 + self.k3 + self.k4, "must be > 0 (a step takes time)")


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    mu: float = 0.3
    """Waterfall threshold: route only if ΔT_best ≥ μ·ΔT_ideal (§5.3; §6 uses 0.3)."""
    phi_wait: int = 3
    """Migrate a rollout's waiting trajectories beyond this many (Alg. 5; §6: 3)."""
    phi_throughput: float = 5.0
    """Redistribute the fastest rollout when T_max/T_min exceeds this (Alg. 5; §6: 5)."""
    policy: str = "waterfall"
    """"waterfall" (Alg. 3: the lowest admissible version group whose best marginal gain
    is at least μ·ΔT_ideal) or "fewest" (§6.5's vanilla routing: the admissible rollout
    with the fewest trajectories, running and waiting, regardless of cost and never
    withheld; ties go to the lowest version). Both keep the staleness protocol's checks."""
    sync: str = "lazy"
    """"lazy" (Alg. 4), "greedy" (pull whenever behind: §6.5's vanilla sync),
    "on_idle" (pull when a rollout has nothing left: Laminar §3) or "global" (verl's
    global weight sync, Laminar Fig. 3a-d: every rollout pulls at once, when none has
    anything left, so one that runs dry early waits for the slowest)."""
    migrate: bool = True
    """Alg. 5 on or off (off = §6.5's vanilla migration: only through sync)."""
    gain_resolution: int = 16
    """Gains are computed at lengths rounded up to this many points per doubling (0:
    exact); see `fnrl.policy.routing.route`."""
    max_routes: int | None = 512
    """Routes per cycle. Gap (ours): Alg. 3 has no cap; when a Consume opens a whole
    buffer, one cycle could admit batch_size × group_size trajectories. Capping bounds a
    cycle's time (about 8 µs per route); the rest are withheld to the next cycle, which is
    what Alg. 3 does with any trajectory it cannot place well yet. None: no cap."""

    moves_per_step: int = 2
    """How many times one trajectory may be moved per training step by the rules that
    move work (migration's two cases, repack, balancing); one moved that often stays
    where it is until the next step (fnrl.policy.cycle). Gap (ours): none of the papers
    bounds it, and under KV pressure a rule that moves waiting work can move the same
    trajectories every cycle; sync's interrupts (a pull) are not counted."""

    def __post_init__(self):
        name = "RoutingConfig"
        check(0 <= self.mu <= 1, name, "mu", self.mu, "must be in [0, 1]")
        check(self.moves_per_step >= 0, name, "moves_per_step", self.moves_per_step,
              "must be >= 0")
        check(self.phi_wait >= 0, name, "phi_wait", self.phi_wait, "must be >= 0")
        check(self.phi_throughput > 1, name, "phi_throughput", self.phi_throughput,
              "must be > 1")
        check(self.max_routes is None or self.max_routes > 0, name, "max_routes",
              self.max_routes, "must be > 0 or None")
        check(self.gain_resolution >= 0, name, "gain_resolution", self.gain_resolution,
              "must be >= 0")
        check(self.sync in SYNC_MODES, name, "sync", self.sync, f"must be one of {SYNC_MODES}")
        check(self.policy in ROUTING_POLICIES, name, "policy", self.policy,
              f"must be one of {ROUTING_POLICIES}")


@dataclass(frozen=True, kw_only=True)
class RepackConfig:
    c_max: float = 0.99
    """KV utilization threshold C_max (§5.2: "e.g., above 99% of total KVCache")."""
    batch_bound: int | None = None
    """Roofline batch size B (§5.2). None: the fitted cost model's k2/k3, the batch at
    which decode turns compute-bound (StaleFlow App. B), i.e. the same roofline point."""
    period_s: float = 5.0
    """Periodic trigger (§5.1: "e.g., 5 seconds"); it also runs right after a publish."""
    pull_released: bool = True
    """Released rollouts pull the newest weights at once (§5.1 step ③)."""
    max_slowdown: float | None = None
    """None: the paper's rule alone (C_max and B). A number: a pack is also admitted only
    while the destination's decode step after it, by the cost model, is at most
    (1 + max_slowdown) × the step of each rollout taking part before it. §5.2 bounds a
    pack by B, "the largest number of trajectories that can be decoded in parallel with
    only a negligible increase in latency", set at the roofline point; that point covers
    the weight and compute terms (k2, k3·n) but not the KV-read term k1·kv, which
    dominates a small-active MoE's step near KV capacity (Qwen3-30B-A3B on H100: k1·kv ≈
    24 ms against k2 ≈ 6.5 ms). Measured in the simulator (docs/simulation.md): for the
    `laminar` preset the paper's rule is the better one (its tails wait for a rollout to
    run dry, so freeing rollouts is worth slowing tails: 229K against 181K tokens/s at
    72B on 1,024 GPUs); under migration and lazy sync 0.1 is (`fnrl` + repack at 1,024
    GPUs: 180K against 120K). Gap: the paper gives no number for "negligible"."""

    def __post_init__(self):
        check(0 < self.c_max <= 1, "RepackConfig", "c_max", self.c_max, "must be in (0, 1]")
        check(self.max_slowdown is None or self.max_slowdown >= 0, "RepackConfig",
              "max_slowdown", self.max_slowdown, "must be >= 0 or None")
        check(self.batch_bound is None or self.batch_bound > 0, "RepackConfig", "batch_bound",
              self.batch_bound, "must be > 0 or None")
        check(self.period_s > 0, "RepackConfig", "period_s", self.period_s, "must be > 0")


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    threshold: float = 0.5
    """Imbalance θ: move only while S_max − S_min exceeds it (§4.2; the value is not
    given, gap: 0.5 means half a KV-full queue, at equal speed, of difference)."""
    max_moves: int = 64
    """Moves per cycle, a bound on the cycle's time and on thrashing (gap: not given)."""

    def __post_init__(self):
        check(self.threshold >= 0, "BalanceConfig", "threshold", self.threshold, "must be >= 0")
        check(self.max_moves >= 0, "BalanceConfig", "max_moves", self.max_moves, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """The rollout coordinator (fnrl.policy.cycle): staleness bound, routing, sync,
    migration, repack, balancing. Presets (fnrl.config.presets) set these."""

    eta: int = 1
    """Staleness bound η: every trained token satisfies V_token + η ≥ V_trainer."""
    stuck_timeout_s: float = 0.0
    """Abort the unfinished groups of a head buffer Stuck this long (0: never)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    cost: CostModel = field(default_factory=CostModel)
    cost_file: str = ""
    """JSON written by `python -m fnrl.experiments.profile_cost` ("auto": the model
    directory's cost_model.json), loaded into `cost` at start; the run's config.json
    keeps the values."""
    sampler: str = "fifo"
    """Which rewarded groups a Consume trains when more than a batch are ready:
    fnrl.policy.samplers.SAMPLERS ("fifo": arrival order; "oldest_version"; "protocol":
    the head buffer as StaleFlow's protocol filled it, no sampler)."""
    # Off when absent. On the command line `coord.repack:on` / `coord.repack:off`, then
    # `--coord.repack.FIELD` (tyro's subcommands for an optional section).
    repack: (Annotated[RepackConfig, tyro.conf.subcommand("on")]
             | Annotated[None, tyro.conf.subcommand("off")]) = None
    """Laminar's dynamic repack of long-tail trajectories (fnrl.policy.repack)."""
    balance: (Annotated[BalanceConfig, tyro.conf.subcommand("on")]
              | Annotated[None, tyro.conf.subcommand("off")]) = None
    """OrchestrRL's reactive request balancing (fnrl.policy.balance)."""

    def __post_init__(self):
        check(self.eta >= 0, "CoordinatorConfig", "eta", self.eta, "must be >= 0")
        check(self.stuck_timeout_s >= 0, "CoordinatorConfig", "stuck_timeout_s",
              self.stuck_timeout_s, "must be >= 0 (0: off)")
        check(self.sampler in SAMPLER_NAMES, "CoordinatorConfig", "sampler", self.sampler,
              f"must be one of {SAMPLER_NAMES}")
