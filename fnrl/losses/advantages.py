"""Advantage estimators and DAPO reward shaping; host-side numpy (DAPO dynamic sampling,
a data-path decision, is fnrl.policy.filtering).

Estimators map group rewards r (G groups × N samples) to advantages of the same
shape. NaN marks an invalid sample: it is left out of every statistic and gets
advantage 0, so it carries no gradient.
"""

from __future__ import annotations

from typing import Sequence

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
    """GRPO: (r - mean_group) / (std_group + eps)."""
    r, valid, _ = _valid(rewards_GxN)
    # Invalid entries were filled with the group mean, so they do not move the mean;
    # the std is taken over valid entries only.
    mean = r.mean(axis=1, keepdims=True)
    std = np.sqrt(np.where(valid, (r - mean) ** 2, 0.0).sum(axis=1, keepdims=True)
                  / np.maximum(valid.sum(axis=1, keepdims=True), 1))
    return _finish((r - mean) / (std + eps), valid)


@register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Dr.GRPO: r - mean_group, no std division (it biases towards easy/hard groups)."""
    r, valid, _ = _valid(rewards_GxN)
    return _finish(r - r.mean(axis=1, keepdims=True), valid)


@register(ADVANTAGES, "rloo")
def rloo_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RLOO: r_i - mean_{j≠i} r_j, the leave-one-out baseline (= n/(n-1)·(r_i - mean))."""
    r, valid, count = _valid(rewards_GxN)
    total = np.where(valid, r, 0.0).sum(axis=1, keepdims=True)
    others = np.maximum(count - 1, 1)
    adv = r - (total - r) / others
    return _finish(np.where(count > 1, adv, 0.0), valid)


@register(ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantages(rewards_GxN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    The batch std (not the group's) keeps the scale comparable across groups without
    amplifying near-zero-variance groups.
    """
    r, valid, _ = _valid(rewards_GxN)
    centred = r - r.mean(axis=1, keepdims=True)
    flat = centred[valid]
    if flat.size == 0:
        return _finish(centred, valid)
    return _finish((centred - flat.mean()) / (flat.std() + eps), valid)


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
