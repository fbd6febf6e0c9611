"""What the controller tells the trainer beside a batch: the learning-rate scale, the
bounds a step must meet for its update to be kept, and a rollback (fnrl.policy.gates).

They travel inside the batch's arrays under reserved keys, so the batch log records
them with the batch and a restarted trainer's replay applies the same scale and bounds
(a rollback is not replayed: the trainer checkpoints its result before the step runs).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

PREFIX = "gate."
NO_ROLLBACK = -1


def pack_controls(*, lr_scale: float, upper: Mapping[str, float], lower: Mapping[str, float],
                  rollback_to: int = NO_ROLLBACK) -> dict[str, np.ndarray]:
    """The reserved arrays for one batch (0-d: float32 values, an int64 rollback)."""
    out = {f"{PREFIX}lr_scale": np.float32(lr_scale),
           f"{PREFIX}rollback_to": np.int64(rollback_to)}
    out.update({f"{PREFIX}max.{k}": np.float32(v) for k, v in upper.items()})
    out.update({f"{PREFIX}min.{k}": np.float32(v) for k, v in lower.items()})
    return {k: np.asarray(v) for k, v in out.items()}


def split_controls(arrays: Mapping[str, np.ndarray]) -> tuple[dict, dict | None, int]:
    """(batch, controls for the jitted step or None, rollback_to) from a batch's arrays.

    controls = {"lr_scale": f32, "max": {metric: f32}, "min": {metric: f32}}; None when
    the arrays carry none (a batch from a caller without gates)."""
    batch = {k: v for k, v in arrays.items() if not k.startswith(PREFIX)}
    if f"{PREFIX}lr_scale" not in arrays:
        return batch, None, NO_ROLLBACK
    controls = {"lr_scale": np.float32(arrays[f"{PREFIX}lr_scale"]), "max": {}, "min": {}}
    for key, value in arrays.items():
        for side in ("max", "min"):
            if key.startswith(f"{PREFIX}{side}."):
                controls[side][key[len(f"{PREFIX}{side}."):]] = np.float32(value)
    return batch, controls, int(arrays.get(f"{PREFIX}rollback_to", NO_ROLLBACK))
