"""LoRA adapters for RL: which projections get them, their rank and scale, and the base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fnrl.config.base import check

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections an adapter may sit on, by their Hugging Face (and PEFT) module names."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters W + (alpha / rank) · A·B on the named projections of every layer
    (Hu et al. 2021; PEFT's conventions: A random, B zero, so version 0 is the base).

    rank: 0 trains every weight (full fine-tuning, the default); > 0 trains only the
    adapters, the rest of the model frozen: the optimizer holds moments for the adapters
    alone, checkpoints hold the adapters, and each version publishes only them (a rollout
    merges them into its base, fnrl.serving.worker_ext).
    base_dtype: the frozen base's storage. auto: the compute dtype (it is only ever
    cast to it, and it needs no float32 master copy: nothing updates it).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    base_dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def __post_init__(self):
        name = "LoraConfig"
        check(type(self.rank) is int and self.rank >= 0, name, "rank", self.rank,
              "must be an int >= 0 (0: no adapters, full fine-tuning)")
        check(isinstance(self.alpha, (int, float)) and self.alpha > 0, name, "alpha",
              self.alpha, "must be > 0")
        targets = tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        check(not unknown and targets and len(set(targets)) == len(targets), name, "targets",
              targets, f"must be distinct names among {LORA_TARGETS}")
        check(self.base_dtype in ("auto", "float32", "bfloat16"), name, "base_dtype",
              self.base_dtype, "must be auto, float32 or bfloat16")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """The adapter's multiplier alpha / rank (PEFT's `scaling`)."""
        return self.alpha / self.rank
