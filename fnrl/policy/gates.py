"""Correctness gates: rules over each train step's telemetry, with actions.

    state, firings = evaluate(state, telemetry, cfg)

Pure: the inputs are a frozen `StepTelemetry` (what the trainer and the batch reported)
and the gates' own immutable `GateState` (recent history, the last good version, the
learning-rate scale); the output is the new state and the `Firing`s, each naming its
rule, the figures it saw and its actions:

  Skip      the update is not kept. Rules that skip are checked *before* the update is
            applied: `limits` turns them into per-metric bounds the trainer enforces inside
            its jitted step (fnrl.trainer.step), so a refused update never touches the
            parameters; the rule here sees the same figures against the same float32
            bounds and records the firing.
  Rollback  restore the newest checkpoint at or before the last good version.
  LowerLR   multiply the learning rate by a factor (the scale lives in the state and
            travels with every batch, so the trainer's replay applies it too).
  Stop      end the run with a report naming the rule and the figures.

Rules are registered by name (`RULES`) and chosen with `--gates.rules`. Repeated skips
(`max_consecutive_skips`) or rollbacks (`max_rollbacks`) escalate to Stop: a fault the
cheap actions do not cure ends the run instead of looping.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from fnrl.config.gates import GatesConfig

# The trainer metric each pre-commit bound applies to (fnrl.trainer.step names them).
KL_KEY, IS_LOW_KEY, IS_HIGH_KEY = "mismatch/kl_k3", "mismatch/is_p01", "mismatch/is_p99"
CLIP_KEY, GRAD_KEY = "clip_frac", "grad_norm"


@dataclass(frozen=True, kw_only=True)
class StepTelemetry:
    """One train step's figures; None where the trainer did not report one."""

    version: int                      # the step trained version -> new_version
    new_version: int
    mismatch_kl: float | None = None
    is_p01: float | None = None
    is_p99: float | None = None
    clip_frac: float | None = None
    grad_norm: float | None = None
    update_ratio: float | None = None   # ‖Δθ‖ / ‖θ‖ of the applied update
    reward_mean: float | None = None
    response_len_mean: float | None = None
    nonfinite: bool = False           # a non-finite loss or gradient: the trainer skipped
    refused: bool = False             # the trainer refused the update on a bound
    rolled_back_to: int | None = None   # answer to a rollback sent with this step (-1: none)


@dataclass(frozen=True)
class Skip:
    pass


@dataclass(frozen=True)
class Rollback:
    to_version: int


@dataclass(frozen=True)
class LowerLR:
    factor: float
    scale: float                      # the learning-rate scale after lowering


@dataclass(frozen=True)
class Stop:
    pass


Action = Skip | Rollback | LowerLR | Stop


@dataclass(frozen=True)
class Firing:
    rule: str
    version: int                      # the step's new version
    actions: tuple[Action, ...]
    figures: Mapping[str, float]
    reason: str

    def record(self) -> dict:
        """A JSON-ready record for the metrics, the journal and the stop report."""
        return {"rule": self.rule, "version": self.version, "reason": self.reason,
                "figures": dict(self.figures),
                "actions": [{"action": type(a).__name__.lower(), **dataclasses.asdict(a)}
                            for a in self.actions]}


@dataclass(frozen=True, kw_only=True)
class GateState:
    grad_norms: tuple[float, ...] = ()     # recent clean steps' gradient norms
    rewards: tuple[float, ...] = ()        # the last `window` steps' mean rewards
    lengths: tuple[float, ...] = ()
    best_reward: float | None = None       # the best full window's mean reward
    ref_length: float | None = None        # the first full window's mean length
    last_good: int = 0
    consecutive_skips: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    stopped: bool = False
    firings: int = 0


def initial_state(version: int, *, lr_scale: float = 1.0, rollbacks: int = 0) -> GateState:
    """The state at the start of an attempt: `version` (the trainer's) is taken as good;
    lr_scale and rollbacks come back from the journal after a restart."""
    return GateState(last_good=version, lr_scale=lr_scale, rollbacks=rollbacks)


def _f32(x: float) -> float:
    # Bounds are compared in float32 inside the step; the same rounding here gives the
    # same verdict on the same figure.
    return float(np.float32(x))


def grad_norm_bound(state: GateState, cfg: GatesConfig) -> float:
    """grad_norm_factor × the median of recent clean non-zero norms, at least
    grad_norm_floor (inf until enough history)."""
    if len(state.grad_norms) < cfg.grad_norm_min_history:
        return math.inf
    return _f32(max(cfg.grad_norm_factor * statistics.median(state.grad_norms),
                    cfg.grad_norm_floor))


def limits(state: GateState, cfg: GatesConfig) -> tuple[dict[str, float], dict[str, float]]:
    """(upper, lower) bounds per trainer metric for the rules that skip: the trainer keeps
    an update only if every metric it reports is within them. The keys depend on the
    rules only, so the step's input structure is the same every step."""
    upper, lower = {}, {}
    on = set(cfg.rules)
    if "mismatch_kl" in on:
        upper[KL_KEY] = _f32(cfg.max_mismatch_kl)
    if "is_weight" in on:
        upper[IS_HIGH_KEY] = _f32(cfg.is_high)
        lower[IS_LOW_KEY] = _f32(cfg.is_low)
    if "clip_frac" in on:
        upper[CLIP_KEY] = _f32(cfg.max_clip_frac)
    if "grad_norm" in on:
        upper[GRAD_KEY] = grad_norm_bound(state, cfg)
    return upper, lower


# --- rules: (telemetry, state, cfg) -> (figures, reason) when it fires, else None -----

Finding = tuple[dict[str, float], str] | None
RULES: dict[str, tuple[str, Callable[[StepTelemetry, GateState, GatesConfig], Finding]]] = {}


def rule(name: str, kind: str):
    """Registers a rule; kind is what it does when it fires: skip, rollback or stop."""
    def wrap(fn):
        RULES[name] = (kind, fn)
        return fn
    return wrap


def _above(value: float | None, bound: float) -> bool:
    return value is not None and not value <= bound   # NaN is above any bound


@rule("nonfinite", "skip")
def nonfinite(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """A non-finite loss or gradient: the trainer already kept its state bit for bit."""
    if tel.nonfinite:
        return {}, "non-finite loss or gradient"
    return None


def _upper_bound(key: str, value: float | None, bound: float, label: str) -> Finding:
    """A finding when `value` is above `bound` (or NaN), named `key` in the figures."""
    bound = _f32(bound)
    if _above(value, bound):
        return {key: value, "bound": bound}, f"{label} {value:.4g} > {bound:.4g}"
    return None


@rule("mismatch_kl", "skip")
def mismatch_kl(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """KL(μ‖π) between the behaviour and the trainer's log-probs above the bound."""
    return _upper_bound("mismatch_kl", tel.mismatch_kl, cfg.max_mismatch_kl,
                        "behaviour/trainer mismatch KL")


@rule("is_weight", "skip")
def is_weight(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """The importance weights π/μ: their 1% or 99% quantile outside [is_low, is_high]."""
    low, high = _f32(cfg.is_low), _f32(cfg.is_high)
    too_low = tel.is_p01 is not None and not tel.is_p01 >= low
    if too_low or _above(tel.is_p99, high):
        return {"is_p01": tel.is_p01, "is_p99": tel.is_p99, "low": low, "high": high}, \
            f"importance-weight quantiles p01={tel.is_p01:.4g} p99={tel.is_p99:.4g} " \
            f"outside [{low:.4g}, {high:.4g}]"
    return None


@rule("clip_frac", "skip")
def clip_frac(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """The fraction of tokens on PPO's clipped branch above the bound."""
    return _upper_bound("clip_frac", tel.clip_frac, cfg.max_clip_frac, "clip fraction")


@rule("grad_norm", "skip")
def grad_norm(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """A gradient norm far above the recent clean steps' median (a spike)."""
    bound = grad_norm_bound(state, cfg)
    if tel.grad_norm is not None and math.isfinite(bound) and _above(tel.grad_norm, bound):
        return {"grad_norm": tel.grad_norm, "bound": bound}, \
            f"gradient norm {tel.grad_norm:.4g} > {cfg.grad_norm_factor:g}x recent median"
    return None


@rule("update_ratio", "rollback")
def update_ratio(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """An applied update too large for the weights (a learning rate far too high)."""
    if not tel.refused and not tel.nonfinite and _above(tel.update_ratio, cfg.max_update_ratio):
        return {"update_ratio": tel.update_ratio, "bound": cfg.max_update_ratio,
                "lr_scale": state.lr_scale}, \
            f"update/weight ratio {tel.update_ratio:.4g} > {cfg.max_update_ratio:.4g}"
    return None


def _window_mean(values: tuple[float, ...], cfg: GatesConfig) -> float | None:
    return sum(values) / len(values) if len(values) == cfg.window else None


@rule("reward_collapse", "stop")
def reward_collapse(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """The recent window's mean reward far below the best window's (state includes this
    step: the windows are updated before the rules run)."""
    mean = _window_mean(state.rewards, cfg)
    best = state.best_reward
    if mean is not None and best is not None and best >= cfg.min_reward \
            and mean < cfg.reward_collapse_frac * best:
        return {"reward_window_mean": mean, "best_window_mean": best,
                "frac": cfg.reward_collapse_frac}, \
            f"mean reward over {cfg.window} steps {mean:.4g} < " \
            f"{cfg.reward_collapse_frac:g} x best {best:.4g}"
    return None


@rule("length_collapse", "stop")
def length_collapse(tel: StepTelemetry, state: GateState, cfg: GatesConfig) -> Finding:
    """The recent window's mean response length far from the first window's."""
    mean, ref = _window_mean(state.lengths, cfg), state.ref_length
    if mean is not None and ref is not None and ref > 0 \
            and not cfg.length_low * ref <= mean <= cfg.length_high * ref:
        return {"length_window_mean": mean, "reference": ref}, \
            f"mean response length over {cfg.window} steps {mean:.4g} outside " \
            f"[{cfg.length_low:g}, {cfg.length_high:g}] x first window {ref:.4g}"
    return None


# --- the state machine -----------------------------------------------------------------

def _push(values: tuple[float, ...], x: float | None, keep: int) -> tuple[float, ...]:
    if x is None or not math.isfinite(x):
        return values
    return (values + (x,))[-keep:]


def _observe(state: GateState, tel: StepTelemetry, cfg: GatesConfig) -> GateState:
    """The windows with this step's batch figures (rewards and lengths describe the
    batch, whatever became of the update)."""
    rewards = _push(state.rewards, tel.reward_mean, cfg.window)
    lengths = _push(state.lengths, tel.response_len_mean, cfg.window)
    mean_r, mean_l = _window_mean(rewards, cfg), _window_mean(lengths, cfg)
    best = state.best_reward
    if mean_r is not None:
        best = mean_r if best is None else max(best, mean_r)
    ref = state.ref_length if state.ref_length is not None else mean_l
    return dataclasses.replace(state, rewards=rewards, lengths=lengths, best_reward=best,
                               ref_length=ref)


def evaluate(state: GateState, tel: StepTelemetry, cfg: GatesConfig
             ) -> tuple[GateState, tuple[Firing, ...]]:
    """Runs every enabled rule on one step; returns the new state and the firings."""
    if state.stopped:
        return state, ()
    prior = state
    state = _observe(state, tel, cfg)
    firings: list[Firing] = []
    for name in cfg.rules:
        kind, fn = RULES[name]
        found = fn(tel, prior if kind != "stop" else state, cfg)
        if found is None:
            continue
        figures, reason = found
        figures = {k: float(v) for k, v in figures.items() if v is not None}
        firings.append(Firing(name, tel.new_version, _actions(kind, state, cfg, name), figures,
                              reason))
        if kind == "rollback" and Stop() not in firings[-1].actions:
            state = dataclasses.replace(state, rollbacks=state.rollbacks + 1,
                                        lr_scale=firings[-1].actions[-1].scale)
    if tel.rolled_back_to is not None and tel.rolled_back_to < 0:
        firings.append(Firing("rollback", tel.new_version, (Stop(),),
                              {"last_good": float(prior.last_good)},
                              f"no checkpoint at or before the last good version "
                              f"{prior.last_good} (raise trainer.checkpoint_keep)"))
    skipped = any(Skip() in f.actions for f in firings)
    rolled = any(isinstance(a, Rollback) for f in firings for a in f.actions)
    skips = state.consecutive_skips + 1 if skipped else 0
    if skipped and skips > cfg.max_consecutive_skips:
        first = next(f for f in firings if Skip() in f.actions)
        firings.append(Firing(f"{first.rule}+max_consecutive_skips", tel.new_version, (Stop(),),
                              {**first.figures, "consecutive_skips": float(skips)},
                              f"{skips} updates skipped in a row (last: {first.reason})"))
    clean = not firings or (skipped and not rolled and state.last_good == tel.version)
    stopped = any(Stop() in f.actions for f in firings)
    state = dataclasses.replace(
        state, consecutive_skips=skips, stopped=stopped, firings=state.firings + len(firings),
        # A refused or rolled-back step leaves good weights at the new version: the
        # trainer checkpoints the version it answers with.
        last_good=tel.new_version if (clean or rolled) else state.last_good,
        grad_norms=(_push(state.grad_norms, tel.grad_norm, 4 * cfg.window)
                    if not firings and (tel.grad_norm or 0.0) > 0 else state.grad_norms))
    return state, tuple(firings)


def _actions(kind: str, state: GateState, cfg: GatesConfig, name: str) -> tuple[Action, ...]:
    if kind == "skip":
        return (Skip(),)
    if kind == "rollback":
        if state.rollbacks >= cfg.max_rollbacks:
            return (Stop(),)
        return (Rollback(state.last_good), LowerLR(cfg.lr_factor, state.lr_scale * cfg.lr_factor))
    return (Stop(),)


def telemetry(metrics: Mapping[str, float], stats: Mapping[str, float], *, version: int,
              new_version: int, rolled_back_to: int | None = None) -> StepTelemetry:
    """StepTelemetry from a step's trainer metrics and batch statistics; a figure the
    trainer did not report is None (the clip fraction is read from any loss term's)."""
    def get(key):
        value = metrics.get(key)
        if value is None:
            value = next((v for k, v in metrics.items() if k.endswith("/" + key)), None)
        return None if value is None else float(value)

    skipped = bool(metrics.get("update_skipped", 0.0))
    return StepTelemetry(
        version=version, new_version=new_version, mismatch_kl=get(KL_KEY),
        is_p01=get(IS_LOW_KEY), is_p99=get(IS_HIGH_KEY), clip_frac=get(CLIP_KEY),
        grad_norm=get(GRAD_KEY), update_ratio=get("update_ratio"),
        reward_mean=stats.get("reward_mean"), response_len_mean=stats.get("response_len_mean"),
        nonfinite=skipped or not all(math.isfinite(v) for v in (
            metrics.get("loss", 0.0), metrics.get(GRAD_KEY, 0.0))),
        refused=bool(metrics.get("gate_refused", 0.0)), rolled_back_to=rolled_back_to)


__all__ = ["Firing", "GateState", "LowerLR", "RULES", "Rollback", "Skip", "StepTelemetry", "Stop",
           "evaluate", "initial_state", "limits", "telemetry"]
