"""An automatic remat checked against XLA's own memory plan of the compiled step.

fnrl.trainer.platform picks the least recomputation whose *estimated* peak fits the
card (fnrl.trainer.memory). XLA's buffer assignment of the compiled step is the figure
that decides whether a step runs, so on an accelerator the trainer compiles its step for
the largest batch it can be sent, on shapes alone (nothing is allocated or run), and
moves on to the next policy while `memory_analysis()` puts it above the device's limit:

    tc, why, step = fit_remat(tc, why, build=lambda tc: ..., args=(state, batch, ref, None),
                              limit=bytes_limit)

The compile is the one the first step needs anyway for that shape only where the
persistent compilation cache holds it; otherwise it is paid twice at start, and only when
remat was left to the platform on an accelerator.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from fnrl.config import RunConfig, TrainerConfig

NEXT_REMAT = {"none": "dots", "dots": "full"}


def compiled_plan(compiled) -> dict[str, int] | None:
    """XLA's buffer plan of a compiled step in bytes: arguments, outputs, what the donated
    arguments alias, temporaries, code, and the peak (arguments + outputs - aliased +
    temporaries); None where the backend reports no analysis."""
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    out = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in
           ("argument", "output", "alias", "temp", "generated_code")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compiled_peak_bytes(lowered) -> int | None:
    """XLA's plan of a lowered step at its peak (`compiled_plan`), compiling it."""
    plan = compiled_plan(lowered.compile())
    return None if plan is None else plan["peak"]


def abstract_batch(cfg: RunConfig, rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays of the largest batch the trainer can be sent, as shapes
    (fnrl.trainer.batching's layout: packed rows carry per-token advantages, segment ids
    and positions; a critic's objective, per-token rewards)."""
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    tokens = {name: jax.ShapeDtypeStruct((rows, length), dtype) for name, dtype in
              (("input_BxT", i32), ("target_BxT", i32), ("mask_BxT", f32),
               ("behaviour_logp_BxT", f32))}
    if cfg.trainer.pack_rows:
        tokens.update({name: jax.ShapeDtypeStruct((rows, length), dtype) for name, dtype in
                       (("adv_BxT", f32), ("segment_ids_BxT", i32), ("positions_BxT", i32))})
    else:
        tokens["adv_B"] = jax.ShapeDtypeStruct((rows,), f32)
    if cfg.algo.uses_critic:
        tokens["reward_BxT"] = jax.ShapeDtypeStruct((rows, length), f32)
    return tokens


def fit_remat(tc: TrainerConfig, why: dict[str, str], *, build: Callable[[TrainerConfig], Any],
              args: tuple, limit: int) -> tuple[TrainerConfig, dict[str, str], Any, Any]:
    """(config, reasons, step, its executable for `args`): `build(tc)`'s step under the
    least remat from `tc.remat` on whose compiled plan for `args` fits `limit` bytes
    ("full" if none does)."""
    why = dict(why)
    while True:
        step = build(tc)
        compiled = step.lower(*args).compile()
        plan = compiled_plan(compiled)
        if plan is None:
            return tc, why, step, compiled
        why["remat"] = (f"{why.get('remat', 'set')}; XLA's compiled plan of {tc.remat}: "
                        f"{plan['peak'] / 2**30:.1f} GiB against the device's "
                        f"{limit / 2**30:.1f} GiB")
        if plan["peak"] <= limit or tc.remat == "full":
            return tc, why, step, compiled
        tc = dataclasses.replace(tc, remat=NEXT_REMAT[tc.remat])
