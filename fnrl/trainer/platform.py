"""The trainer's platform defaults: every "auto" of TrainerConfig made concrete, with why.

    tc, why = resolve_for_device(cfg.trainer, platform="gpu", model=model_cfg, algo=cfg.algo,
                                 rows=8, length=2048, device_bytes=80 * 2**30)
    print(describe(tc, why))

On GPU the trainer computes in bfloat16 over float32 master weights, attends with
cuDNN's fused kernel, keeps every activation for the backward pass where the memory
plan fits the card (remat "none"), else the weight matmuls' outputs ("dots"), else only
each layer's input ("full"), and runs float32 matmuls (there are few: none in bfloat16 compute) at
full precision rather than TF32. On CPU it computes in float32 with the xla attention
and no remat, as before these defaults existed. Log-probs are chunked everywhere
(`logprob_chunk` has a concrete default). Anything set explicitly is kept as set.

Pure: the platform and the card's size are arguments, so the choice is testable on CPU
(tests/trainer/test_platform.py) and the same function runs in the trainer process,
the memory plan (fnrl.backends.memory) and the benchmarks. The memory-aware remat
choice is `fnrl.trainer.memory.resolve_for_device`, which gives this one the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from fnrl.config import TrainerConfig
from fnrl.models.attention import cudnn_unsupported
from fnrl.models.decoder import DecoderConfig

PLATFORMS = ("cpu", "gpu", "tpu")

DEVICE_HEADROOM = 0.9
"""Share of a card's memory a remat choice may plan to use: XLA's allocator, cuDNN's
workspace and fragmentation take the rest."""


def _remat(tc: TrainerConfig, platform: str, device_bytes: int | None,
           peak_bytes: Callable[[TrainerConfig], int] | None) -> tuple[str, str]:
    if platform == "cpu":
        return "none", "CPU: XLA's CPU scheduler keeps memory low without remat"
    if peak_bytes is None or not device_bytes:
        return "dots", f"{platform}: recompute only elementwise work (no memory plan given)"
    budget = DEVICE_HEADROOM * device_bytes
    # The least recomputation that fits: none, then the elementwise work, then layers.
    for remat in ("none", "dots", "full"):
        peak = peak_bytes(dataclasses.replace(tc, remat=remat))
        if peak <= budget:
            return remat, (f"{platform}: plan {peak / 2**30:.1f} GiB against "
                           f"{budget / 2**30:.1f} GiB of the card")
    # Not refused: the plan's figures are estimates, and XLA's own plan of the compiled
    # step (lab/benchmarks/train_step.py prints it) may fit where this one does not.
    return "full", (f"{platform}: plan {peak / 2**30:.1f} GiB even with full remat, above "
                    f"{budget / 2**30:.1f} GiB of the card: may not fit (micro-batches, "
                    "shorter rows or FSDP over more devices would)")


def resolve_trainer(tc: TrainerConfig, *, platform: str, model: DecoderConfig | None = None,
                    device_bytes: int | None = None,
                    peak_bytes: Callable[[TrainerConfig], int] | None = None
                    ) -> tuple[TrainerConfig, dict[str, str]]:
    """`tc` with every "auto" replaced for `platform` ("cpu", "gpu", "tpu"), and the
    reason for each choice made. On an accelerator remat is the first of "none", "dots"
    and "full" whose `peak_bytes(config)` (a memory plan,
    fnrl.trainer.memory.resolve_for_device) fits the card's `device_bytes`; "dots"
    without a plan."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    why: dict[str, str] = {}
    changes: dict[str, str] = {}
    accelerator = platform != "cpu"
    if tc.compute_dtype == "auto":
        changes["compute_dtype"] = "bfloat16" if accelerator else "float32"
        why["compute_dtype"] = (f"{platform}: bfloat16 over float32 master weights"
                                if accelerator else "CPU: no fast bfloat16 matmuls")
    compute = changes.get("compute_dtype", tc.compute_dtype)
    if tc.attention == "auto":
        reason = (None if model is None and platform == "gpu" else
                  cudnn_unsupported(dtype=jnp.dtype(compute), platform=platform,
                                    head_dim=model.head_dim if model is not None else 128))
        changes["attention"] = "xla" if reason else "cudnn"
        why["attention"] = reason or "GPU: cuDNN fused flash attention"
    if tc.matmul_precision == "auto":
        changes["matmul_precision"] = "highest" if compute == "float32" else "default"
        why["matmul_precision"] = ("float32 compute: full-precision matmuls (no TF32)"
                                   if compute == "float32" else "bfloat16 compute")
    resolved = dataclasses.replace(tc, **changes)
    if tc.remat == "auto":
        remat, why["remat"] = _remat(resolved, platform, device_bytes, peak_bytes)
        resolved = dataclasses.replace(resolved, remat=remat)
    return resolved, why


def describe(tc: TrainerConfig, why: dict[str, str]) -> str:
    """One line of what the trainer computes with, each automatic choice with its reason."""
    parts = []
    for name in ("compute_dtype", "attention", "remat", "matmul_precision"):
        value = getattr(tc, name)
        parts.append(f"{name}={value}" + (f" (auto: {why[name]})" if name in why else ""))
    parts.append(f"param_dtype={tc.param_dtype}")
    parts.append(f"logprob_chunk={tc.logprob_chunk or 'off'}")
    return "trainer kernels: " + ", ".join(parts)


def model_kernels(tc: TrainerConfig) -> dict:
    """The Decoder's kernel options of a resolved TrainerConfig (`init_model(**...)`)."""
    if "auto" in (tc.remat, tc.attention, tc.compute_dtype):
        raise ValueError("resolve_trainer first: the trainer config still has 'auto' values")
    return {"remat": tc.remat, "attention": tc.attention,
            "max_segments": tc.pack_max_segments if tc.pack_rows else 0,
            "lora": tc.lora if tc.lora.enabled else None}


def storage_dtype(tc: TrainerConfig) -> str:
    """The dtype the loaded weights are held in: `param_dtype`, or with LoRA the frozen
    base's (`lora.base_dtype`; auto: the compute dtype, which is all it is cast to)."""
    if not tc.lora.enabled:
        return tc.param_dtype
    if tc.lora.base_dtype != "auto":
        return tc.lora.base_dtype
    if tc.compute_dtype == "auto":
        raise ValueError("resolve_trainer first: the trainer config still has 'auto' values")
    return tc.compute_dtype
