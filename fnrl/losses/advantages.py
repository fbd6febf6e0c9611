"""Advantage estimators and DAPO reward shaping; host-side numpy (DAPO dynamic sampling,
a data-path decision, is fnrl.policy.filtering).

Estimators map group rewards r (G groups × N samples) to advantages of the same
shape. NaN marks an invalid sample: it is left out of every statistic and gets
advantage 0, so it carries no gradient.

An estimator is `fn(rewards_GxN, eps, **keyword_only)`. Its keyword-only parameters
are read from the AlgoConfig field of the same name, and one named `lengths_GxN`
receives the response lengths (see `compute_advantages`).

Standard deviations here divide by n, the number of valid samples (numpy's default,
ddof = 0), not n - 1: a group of rewards (1, 0) has std 0.5 and advantages ±1. verl
and TRL use torch.std, which divides by n - 1 (std 0.71, advantages ±0.71); the two
differ by the factor sqrt((n-1)/n), 0.94 for groups of 8.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import numpy as np

from fnrl.losses.core import ADVANTAGES, register


def _valid(rewards_GxN) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = np.asarray(rewards_GxN, dtype=np.float64)
    valid = np.isfinite(r)
    count = valid.sum(axis=1, keepdims=True)
    mean = np.where(valid, r, 0.0).sum(axis=1, keepdims=True) / np.maximum(count, 1)
    return np.where(valid, r, mean), valid, count


def _finish(adv, valid) -> np.ndarray:
    return np.where(valid, adv, 0.0).astype(np.float32)


@register(ADVANTAGES, "grpo")
def grpo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO (DeepSeekMath, arXiv 2402.03300): (r - mean_group) / (std_group + eps).

    std divides by the number of valid samples n (not n - 1; see the module docstring).
    """
    r, valid, _ = _valid(rewards_GxN)
    # Invalid entries were filled with the group mean, so they do not move the mean;
    # the std is taken over valid entries only.
    mean = r.mean(axis=1, keepdims=True)
    std = np.sqrt(np.where(valid, (r - mean) ** 2, 0.0).sum(axis=1, keepdims=True)
                  / np.maximum(valid.sum(axis=1, keepdims=True), 1))
    return _finish((r - mean) / (std + eps), valid)


@register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Dr.GRPO (arXiv 2503.20783): r - mean_group, no std division (the division
    up-weights groups that are almost all right or all wrong)."""
    r, valid, _ = _valid(rewards_GxN)
    return _finish(r - r.mean(axis=1, keepdims=True), valid)


@register(ADVANTAGES, "rloo")
def rloo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RLOO (arXiv 2402.14740): r_i - mean_{j≠i} r_j, the leave-one-out baseline
    (= n/(n-1)·(r_i - mean))."""
    r, valid, count = _valid(rewards_GxN)
    total = np.where(valid, r, 0.0).sum(axis=1, keepdims=True)
    others = np.maximum(count - 1, 1)
    adv = r - (total - r) / others
    return _finish(np.where(count > 1, adv, 0.0), valid)


@register(ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """REINFORCE++-baseline (arXiv 2501.03262): subtract the group mean, then whiten
    over the whole batch.

    The batch std (not the group's; it divides by n) keeps the scale comparable across
    groups without amplifying near-zero-variance groups.
    """
    r, valid, _ = _valid(rewards_GxN)
    centred = r - r.mean(axis=1, keepdims=True)
    flat = centred[valid]
    if flat.size == 0:
        return _finish(centred, valid)
    return _finish((centred - flat.mean()) / (flat.std() + eps), valid)


@register(ADVANTAGES, "gpg")
def gpg_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GPG (arXiv 2504.02546): α·(r - mean_group), no std division (F_norm = 1).

    α = B / (B - M) rescales for the M samples (of B valid ones in the step) whose group
    has zero reward variance: their advantage is 0, so without α they would dilute the
    batch's mean gradient (the paper's "accurate gradient estimation", as we read it;
    verl's α divides by the count of non-zero rewards instead). The paper also allows
    F_norm = std; use the `grpo` advantages for that.
    """
    r, valid, count = _valid(rewards_GxN)
    centred = r - r.mean(axis=1, keepdims=True)
    flat_groups = np.where(valid, np.abs(centred), 0.0).max(axis=1) == 0   # zero variance
    total = int(valid.sum())
    dead = int(count[flat_groups].sum())
    alpha = total / (total - dead) if total > dead else 1.0
    return _finish(alpha * centred, valid)


@register(ADVANTAGES, "opo")
def opo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6, *,
                   lengths_GxN: np.ndarray | None = None) -> np.ndarray:
    """OPO (arXiv 2505.23585): r_i - b, with the length-weighted baseline
    b = Σ_j l_j·r_j / Σ_j l_j over the group's valid samples (l: response tokens).

    The paper derives b as the variance-minimising baseline when the gradient of a
    sequence's log-likelihood grows with its length, and pairs it with exactly
    on-policy training (one optimizer step per batch, η = 0). A group whose lengths sum
    to 0 falls back to the plain mean.
    """
    if lengths_GxN is None:
        raise ValueError("the 'opo' advantage needs the response lengths (lengths_GxN)")
    r, valid, _ = _valid(rewards_GxN)
    lengths = np.where(valid, np.asarray(lengths_GxN, np.float64), 0.0)
    weight = lengths.sum(axis=1, keepdims=True)
    weighted = (lengths * r).sum(axis=1, keepdims=True) / np.maximum(weight, 1e-12)
    baseline = np.where(weight > 0, weighted, r.mean(axis=1, keepdims=True))
    return _finish(r - baseline, valid)


@register(ADVANTAGES, "passk")
def passk_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6, *, pass_k: int = 4
                     ) -> np.ndarray:
    """Pass@k training, analytic advantages (Chen et al., arXiv 2508.10751, §4).

    The reward of a k-subset of the group is 1 if any member is correct; the advantage
    of a response is the mean normalised advantage of the subsets holding it. For a
    group of n valid samples with c correct (reward > 0; pass@k needs binary outcomes):
        R̄ = 1 - C(n-c, k)/C(n, k),   σ = sqrt(R̄·(1 - R̄))
        A_correct = (1 - R̄) / σ
        A_wrong   = (1 - R̄ - C(n-c-1, k-1)/C(n-1, k-1)) / σ
    k = 1 gives GRPO on binary rewards. A group with fewer than k valid samples uses
    k = n; σ = 0 (all wrong, or every subset holds a correct one) gives 0.
    """
    r, valid, count = _valid(rewards_GxN)
    adv = np.zeros_like(r)
    for g in range(r.shape[0]):
        n = int(count[g, 0])
        if n < 2:
            continue
        k = min(int(pass_k), n)
        correct = valid[g] & (r[g] > 0)
        c = int(correct.sum())
        mean = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        std = math.sqrt(mean * (1.0 - mean))
        if std == 0.0:
            continue
        a_wrong = (1.0 - mean - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)
                   if c < n else 0.0)
        adv[g] = np.where(correct, (1.0 - mean) / (std + eps), a_wrong / (std + eps))
    return _finish(adv, valid)


def compute_advantages(rewards_GxN: np.ndarray, algo: Any,
                       lengths_GxN: np.ndarray | None = None) -> np.ndarray:
    """The advantages of `algo.advantage` with its hyperparameters read from `algo`.

    Each keyword-only parameter of the estimator takes the AlgoConfig field of the same
    name (as loss terms do); `lengths_GxN` (response tokens per sample) goes to the
    estimators that ask for it.
    """
    if algo.advantage not in ADVANTAGES:
        raise ValueError(f"unknown advantage {algo.advantage!r}; registered: {sorted(ADVANTAGES)}")
    fn = ADVANTAGES[algo.advantage]
    kwargs = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not p.KEYWORD_ONLY:
            continue
        if p.name == "lengths_GxN":
            kwargs[p.name] = lengths_GxN
        elif hasattr(algo, p.name):
            kwargs[p.name] = getattr(algo, p.name)
    return fn(rewards_GxN, algo.adv_eps, **kwargs)


def overlong_penalty(lengths: Sequence[int], *, max_len: int, buffer: int,
                     factor: float = 1.0) -> np.ndarray:
    """DAPO soft overlong punishment, added to the reward.

    0 up to max_len - buffer, then falls linearly to -factor at max_len, and -factor
    beyond: long answers are discouraged before they hit the hard cut.
    """
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths, dtype=np.float32)
    start = max_len - buffer
    ramp = np.clip((lengths - start) / buffer, 0.0, 1.0)
    return (-factor * ramp).astype(np.float32)
