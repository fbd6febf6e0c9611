"""The config tree: keyword-only frozen dataclasses, validated where they are built.

Every invalid value raises a ValueError that names the field and the value, so a
bad command line fails before any process starts. The command line is parsed by
`tyro` from these classes, which also rejects unknown keys by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


def _check(cond: bool, owner: str, name: str, value: Any, why: str) -> None:
    if not cond:
        raise ValueError(f"invalid config {owner}.{name}={value!r}: {why}")


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value > 0, type(obj).__name__, name, value, "must be > 0")


# Head sizes vLLM's CPU attention backend accepts (vllm 0.32 cpu_attn.py); GPU backends
# accept these too.
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The synthetic arithmetic task (see fnrl.data.arith)."""

    seed: int = 1234
    num_eval: int = 256
    min_level: int = 1
    max_level: int = 4

    def __post_init__(self):
        _positive(self, "num_eval")
        _check(1 <= self.min_level <= self.max_level <= 5, "TaskConfig", "min_level..max_level",
               (self.min_level, self.max_level), "need 1 <= min_level <= max_level <= 5")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train. `model_dir` empty means the embedded tiny default."""

    model_dir: str = ""
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    seed: int = 0

    def __post_init__(self):
        _positive(self, "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "ModelConfig",
               "num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")
        head_dim = self.hidden_size // self.num_attention_heads
        _check(head_dim in VLLM_HEAD_SIZES, "ModelConfig", "hidden_size/num_attention_heads",
               head_dim, f"vLLM's attention kernels support head sizes {VLLM_HEAD_SIZES}")


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Short supervised phase that makes the embedded model sometimes right."""

    steps: int = 140
    batch_size: int = 64
    learning_rate: float = 3e-3
    cache_dir: str = "~/.cache/fnrl/models"

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "learning_rate")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """GRPO with clip-higher, token-level aggregation and AdamW."""

    group_size: int = 8
    groups_per_step: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adv_eps: float = 1e-6

    def __post_init__(self):
        _positive(self, "group_size", "groups_per_step", "max_new_tokens", "learning_rate",
                  "max_grad_norm")
        _check(self.group_size >= 2, "AlgoConfig", "group_size", self.group_size,
               "GRPO needs at least 2 samples per group")
        _check(0 < self.clip_low < 1, "AlgoConfig", "clip_low", self.clip_low, "must be in (0, 1)")
        _check(self.clip_high > 0, "AlgoConfig", "clip_high", self.clip_high, "must be > 0")
        _check(self.temperature > 0, "AlgoConfig", "temperature", self.temperature, "must be > 0")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """vLLM generation servers."""

    num_servers: int = 1
    max_num_seqs: int = 256
    kv_memory_fraction: float = 0.2
    groups_per_batch: int = 16
    start_timeout_s: float = 600.0
    request_timeout_s: float = 300.0

    def __post_init__(self):
        _positive(self, "num_servers", "max_num_seqs", "groups_per_batch", "start_timeout_s",
                  "request_timeout_s")
        _check(0 < self.kv_memory_fraction < 1, "RolloutConfig", "kv_memory_fraction",
               self.kv_memory_fraction, "must be in (0, 1)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole job. `mode` picks how generation and training are scheduled."""

    mode: Literal["sync", "laminar"] = "laminar"
    steps: int = 60
    eval_every: int = 10
    max_staleness: int = 4
    seed: int = 0
    run_dir: str = ""
    resume: bool = True
    trainer_timeout_s: float = 600.0
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self):
        _positive(self, "steps", "eval_every", "trainer_timeout_s")
        _check(self.max_staleness >= 0, "RunConfig", "max_staleness", self.max_staleness,
               "must be >= 0")
        _check(self.mode in ("sync", "laminar"), "RunConfig", "mode", self.mode,
               "must be 'sync' or 'laminar'")

    @property
    def batch_size(self) -> int:
        return self.algo.group_size * self.algo.groups_per_step


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict) -> Any:
    """Builds a config from a nested dict, naming any key the class does not have."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"unknown config key(s) for {cls.__name__}: {', '.join(unknown)}")
    kwargs = {}
    for key, value in data.items():
        sub = names[key].default_factory if names[key].default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict) and sub is not None and dataclasses.is_dataclass(sub):
            kwargs[key] = from_dict(sub, value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def save_json(cfg: Any, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True))


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
