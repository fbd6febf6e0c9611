"""Configuration of the correctness gates (fnrl.policy.gates); the numerical faults that
test them are injected with `--faults.inject.*` (fnrl.config.faults).

The defaults come from two default `math_grpo` runs (60 and 40 steps, η = 2; see
docs/gates.md): no rule fires on them, and each threshold sits several times above the
worst figure they reached, so a gate fires on a fault, not on noise."""

from __future__ import annotations

from dataclasses import dataclass

from fnrl.config.base import check, finite, positive

GATE_RULE_NAMES = ("nonfinite", "mismatch_kl", "is_weight", "clip_frac", "grad_norm",
                   "update_ratio", "reward_collapse", "length_collapse")
DEFAULT_RULES = GATE_RULE_NAMES


@dataclass(frozen=True, kw_only=True)
class GatesConfig:
    """Rules over each step's telemetry and their actions (`--gates.*`)."""

    rules: tuple[str, ...] = DEFAULT_RULES
    """The rules that are on, by registered name (fnrl.policy.gates.RULES); empty: none."""
    max_mismatch_kl: float = 0.05
    """mismatch_kl: KL(μ‖π) (k3 estimate) between the behaviour and the trainer's
    log-probs above this skips the update. Healthy runs report 1e-4..1e-3 (Yao et al.,
    "Your efficient RL framework secretly brings you off-policy RL training", 2025; our
    default runs peak at 0.006 with η = 2 staleness included)."""
    is_low: float = 0.5
    is_high: float = 2.0
    """is_weight: the 1% quantile of π/μ below is_low, or the 99% above is_high, skips the
    update: the band IcePop and verl's token mask keep tokens in (default runs: 0.81..1.19)."""
    max_clip_frac: float = 0.2
    """clip_frac: more than this fraction of tokens on PPO's clipped branch skips the
    update. With one update per batch it measures how far π is from μ; PPO's own healthy
    range is 0.1..0.2 with several epochs (default runs: at most 0.008)."""
    grad_norm_factor: float = 10.0
    """grad_norm: a gradient norm (before clipping) this many times the median of the
    recent clean steps skips the update (default runs: at most 4× their median)."""
    grad_norm_min_history: int = 5
    """Clean steps with a non-zero gradient the median needs before grad_norm fires (a
    batch whose groups all tie has a zero gradient, which says nothing about scale)."""
    grad_norm_floor: float = 1.0
    """grad_norm never fires at or below this norm: algo.max_grad_norm's default, a norm
    the clipping leaves as it is."""
    max_update_ratio: float = 0.01
    """update_ratio: ‖Δθ‖/‖θ‖ of the applied update above this rolls back to the last
    good checkpoint and lowers the learning rate. The usual healthy band is about 1e-3
    (Karpathy's update-to-weight heuristic); an update 100× too large lands far above."""
    lr_factor: float = 0.1
    """What one lower_lr action multiplies the learning rate by."""
    window: int = 8
    """Steps in the windows of the collapse rules (and of grad_norm's median: 4 windows)."""
    reward_collapse_frac: float = 0.3
    """reward_collapse: a window's mean reward below this fraction of the best window seen
    (once that best is at least min_reward) stops the run."""
    min_reward: float = 0.1
    length_low: float = 0.25
    length_high: float = 4.0
    """length_collapse: a window's mean response length below length_low or above
    length_high times the first full window's stops the run."""
    max_consecutive_skips: int = 6
    """Skipped updates in a row (any rule, or non-finite) after which the run stops: a
    bad publish is flushed after at most η + 1 consumed versions."""
    max_rollbacks: int = 3
    """Rollbacks after which a further rollback stops the run instead."""

    def __post_init__(self):
        name = "GatesConfig"
        object.__setattr__(self, "rules", tuple(self.rules))
        for rule in self.rules:
            check(rule in GATE_RULE_NAMES, name, "rules", rule,
                  f"unknown rule; known: {', '.join(GATE_RULE_NAMES)}")
        check(len(set(self.rules)) == len(self.rules), name, "rules", self.rules,
              "names a rule twice")
        for field_name in ("max_mismatch_kl", "is_high", "max_clip_frac", "grad_norm_factor",
                           "max_update_ratio", "length_high", "grad_norm_floor"):
            value = getattr(self, field_name)
            check(finite(value) and value > 0, name, field_name, value,
                  "must be a finite number > 0")
        check(0 <= self.is_low < 1 < self.is_high, name, "is_low..is_high",
              (self.is_low, self.is_high), "need 0 <= is_low < 1 < is_high")
        check(0 < self.lr_factor < 1, name, "lr_factor", self.lr_factor, "must be in (0, 1)")
        check(0 < self.reward_collapse_frac < 1, name, "reward_collapse_frac",
              self.reward_collapse_frac, "must be in (0, 1)")
        check(0 < self.length_low < 1, name, "length_low", self.length_low, "must be in (0, 1)")
        check(self.length_high > 1, name, "length_high", self.length_high, "must be > 1")
        check(finite(self.min_reward), name, "min_reward", self.min_reward, "must be finite")
        check(self.max_clip_frac <= 1, name, "max_clip_frac", self.max_clip_frac,
              "must be <= 1 (a fraction)")
        positive(self, "window", "grad_norm_min_history", "max_consecutive_skips")
        check(self.max_rollbacks >= 0, name, "max_rollbacks", self.max_rollbacks, "must be >= 0")
