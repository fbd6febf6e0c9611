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

from fnrl.data.experience import SAMPLERS
from fnrl.policy.balance import BalanceConfig
from fnrl.policy.faults import FaultConfig
from fnrl.policy.repack import RepackConfig
from fnrl.policy.routing import CostModel, RoutingConfig
from fnrl.relay.config import RelayConfig


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
    """The prompts: the synthetic arithmetic task (fnrl.data.arith), or JSONL files
    (fnrl.data.dataset) when `dataset` names one."""

    seed: int = 1234
    num_eval: int = 256
    min_level: int = 1
    max_level: int = 4
    dataset: str = ""
    """JSONL of training rows; empty: the synthetic task."""
    eval_dataset: str = ""
    """JSONL of eval rows; empty: num_eval rows of `dataset` are held out instead."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    on_bad_row: Literal["skip", "error"] = "skip"
    """skip: a malformed row is skipped and recorded in bad_rows.jsonl; error: stop."""

    def __post_init__(self):
        _positive(self, "num_eval")
        _check(1 <= self.min_level <= self.max_level <= 5, "TaskConfig", "min_level..max_level",
               (self.min_level, self.max_level), "need 1 <= min_level <= max_level <= 5")
        _check(self.on_bad_row in ("skip", "error"), "TaskConfig", "on_bad_row", self.on_bad_row,
               "must be 'skip' or 'error'")
        _check(not self.eval_dataset or self.dataset, "TaskConfig", "eval_dataset",
               self.eval_dataset, "needs task.dataset (the synthetic task has its own eval split)")
        for name in ("prompt_key", "answer_key"):
            _check(bool(getattr(self, name)), "TaskConfig", name, getattr(self, name),
                   "must name a field")
        _check(self.prompt_key != self.answer_key, "TaskConfig", "answer_key", self.answer_key,
               "must differ from prompt_key")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train. `model_dir` empty means the embedded tiny default."""

    model_dir: str = ""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32
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
    """Short supervised phase that makes the embedded model sometimes right.

    The demonstrations come from an imperfect teacher: a fraction `demo_error_rate` of
    them end the right answer with a stray trailing "0" (a systematic habit, like the
    formatting slips SFT data carries into real models). Greedy decoding inherits the
    habit, while sampling still often stops at the right place, so the verifiable
    reward has something to correct and the warm-started policy is sometimes right.
    """

    steps: int = 450
    batch_size: int = 64
    learning_rate: float = 1e-3
    demo_error_rate: float = 0.6
    cache_dir: str = "~/.cache/fnrl/models"

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "learning_rate")
        _check(0.0 <= self.demo_error_rate < 1.0, "WarmStartConfig", "demo_error_rate",
               self.demo_error_rate, "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """The RL algorithm: loss terms by registered name, advantages, corrections, AdamW.

    The default is GRPO with clip-higher (DAPO) and token-mean aggregation. Every
    keyword-only hyperparameter of a loss term is read from the field of the same
    name (fnrl.losses.objective.bind_term).
    """

    group_size: int = 8
    groups_per_step: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # Loss: (registered term name, weight) pairs (fnrl.losses.LOSS_TERMS); on the
    # command line `--algo.loss-terms aipo 1.0 gspo 0.5`.
    loss_terms: tuple[tuple[str, float], ...] = (("ppo_clip", 1.0),)
    aggregation: str = "token_mean"
    aggregation_norm_len: int = 0       # Dr.GRPO's constant; 0 -> max_new_tokens
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    # PPO / decoupled PPO / dual clip.
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float = 0.0            # 0 = off; else > 1
    behaviour_cap: float = 0.0          # decoupled PPO: drop tokens with π_prox/μ > cap; 0 = off
    # AIPO: one-sided truncation of π/μ at ρ (LlamaRL recommends 2..10).
    aipo_rho: float = 4.0
    # GSPO's sequence-ratio clip range.
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    # Train/inference mismatch correction (fnrl.losses.correction).
    correction: str = "none"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    # KL to the frozen initial model; 0 -> no reference forward pass.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"                 # "loss" (a term) or "reward" (shapes advantages)
    entropy_coef: float = 0.0
    # DAPO: drop zero-variance groups; soft overlong punishment over the last tokens.
    dynamic_sampling: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        from fnrl.losses import ADVANTAGES, LOSS_TERMS
        from fnrl.losses.aggregation import AGGREGATIONS
        from fnrl.losses.correction import CORRECTIONS
        from fnrl.losses.kl import KL_ESTIMATORS

        name = "AlgoConfig"
        _positive(self, "group_size", "groups_per_step", "max_new_tokens", "learning_rate",
                  "max_grad_norm", "aipo_rho", "gspo_clip_low", "gspo_clip_high", "tis_cap")
        _check(self.group_size >= 2, name, "group_size", self.group_size,
               "GRPO needs at least 2 samples per group")
        _check(0 < self.clip_low < 1, name, "clip_low", self.clip_low, "must be in (0, 1)")
        _check(self.clip_high > 0, name, "clip_high", self.clip_high, "must be > 0")
        _check(self.temperature > 0, name, "temperature", self.temperature, "must be > 0")
        # JSON gives lists back; keep one hashable canonical form.
        object.__setattr__(self, "loss_terms", tuple((str(t), float(w)) for t, w in self.loss_terms))
        _check(len(self.loss_terms) > 0, name, "loss_terms", self.loss_terms,
               "must name at least one registered term with a weight")
        _check(len({t for t, _ in self.loss_terms}) == len(self.loss_terms), name, "loss_terms",
               self.loss_terms, "a term is named twice")
        for term, weight in self.loss_terms:
            _check(term in LOSS_TERMS, name, "loss_terms", term,
                   f"not a registered loss term; known: {sorted(LOSS_TERMS)}")
            _check(term not in ("kl", "entropy"), name, "loss_terms", term,
                   "set kl_coef / entropy_coef instead")
            _check(finite(weight), name, f"loss_terms[{term!r}]", weight, "must be finite")
        _check(self.aggregation in AGGREGATIONS, name, "aggregation", self.aggregation,
               f"must be one of {sorted(AGGREGATIONS)}")
        _check(self.aggregation_norm_len >= 0, name, "aggregation_norm_len",
               self.aggregation_norm_len, "must be >= 0")
        _check(self.advantage in ADVANTAGES, name, "advantage", self.advantage,
               f"must be one of {sorted(ADVANTAGES)}")
        _check(self.dual_clip_c == 0 or self.dual_clip_c > 1, name, "dual_clip_c",
               self.dual_clip_c, "must be 0 (off) or > 1")
        _check(self.behaviour_cap == 0 or self.behaviour_cap > 1, name, "behaviour_cap",
               self.behaviour_cap, "must be 0 (off) or > 1")
        _check(self.correction in CORRECTIONS, name, "correction", self.correction,
               f"must be one of {CORRECTIONS}")
        _check(self.tis_cap >= 1, name, "tis_cap", self.tis_cap, "must be >= 1")
        _check(0 <= self.mask_low < 1 < self.mask_high, name, "mask_low..mask_high",
               (self.mask_low, self.mask_high), "need 0 <= mask_low < 1 < mask_high")
        _check(finite(self.kl_coef) and self.kl_coef >= 0, name, "kl_coef", self.kl_coef,
               "must be >= 0")
        _check(self.kl_estimator in KL_ESTIMATORS, name, "kl_estimator", self.kl_estimator,
               f"must be one of {sorted(KL_ESTIMATORS)}")
        _check(self.kl_in in ("loss", "reward"), name, "kl_in", self.kl_in,
               "must be 'loss' or 'reward'")
        _check(finite(self.entropy_coef) and self.entropy_coef >= 0, name, "entropy_coef",
               self.entropy_coef, "must be >= 0")
        _check(self.overlong_buffer >= 0, name, "overlong_buffer", self.overlong_buffer,
               "must be >= 0")
        _check(self.overlong_buffer < self.max_new_tokens or self.overlong_buffer == 0, name,
               "overlong_buffer", self.overlong_buffer, "must be < max_new_tokens")
        _check(self.overlong_penalty >= 0, name, "overlong_penalty", self.overlong_penalty,
               "must be >= 0")

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must hold the frozen initial model."""
        return self.kl_coef > 0


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Trainer mesh shape over axes ("data", "fsdp", "tensor"); data=-1 takes the rest."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        _check(self.data == -1 or self.data > 0, "MeshConfig", "data", self.data,
               "must be -1 (all remaining devices) or > 0")
        _positive(self, "fsdp", "tensor")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How the trainer lays out and splits each batch.

    length_buckets: static row lengths; a batch takes the smallest that fits, so the
    step compiles at most once per bucket (empty: powers of two from 16 up to the model's
    maximum length).
    pack_rows: 0 = one sequence per row; > 0 = pack sequences into this many rows,
    keeping each GRPO group inside one micro-batch.
    """

    micro_batches: int = 1
    length_buckets: tuple[int, ...] = ()
    pack_rows: int = 0
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self):
        name = "TrainerConfig"
        _positive(self, "micro_batches")
        buckets = tuple(self.length_buckets)
        object.__setattr__(self, "length_buckets", buckets)
        _check(all(isinstance(b, int) and b > 1 for b in buckets), name, "length_buckets", buckets,
               "must be ints > 1")
        _check(list(buckets) == sorted(set(buckets)), name, "length_buckets", buckets,
               "must be strictly increasing")
        _check(self.pack_rows >= 0, name, "pack_rows", self.pack_rows, "must be >= 0")
        _check(self.pack_rows % self.micro_batches == 0, name, "pack_rows", self.pack_rows,
               f"must be a multiple of micro_batches={self.micro_batches}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """vLLM generation servers and the response-length workload they are given.

    `response_len`: "natural" lets each response end at EOS (at most
    algo.max_new_tokens). "lognormal" and "pareto" force every trajectory to a length
    drawn per trajectory from a heavy-tailed distribution (median `len_median`,
    clipped to [1, `len_max`]): the request sets `ignore_eos`, the answer graded is the
    text before the first EOS, and the tokens after it stand for a reasoning model's
    long tail. It makes generation time long-tailed on any machine (fnrl.control.workload).
    """

    num_servers: int = 1
    max_num_seqs: int = 256
    kv_memory_fraction: float = 0.2
    groups_per_batch: int = 16
    """Fresh prompt groups kept waiting in the trajectory server."""
    kv_capacity_tokens: int = 0
    """KV budget per server the coordinator plans with, in tokens (0: the server's own,
    from /metrics). On CPU the server's budget is a slice of RAM, far above what one
    core can decode; a smaller budget makes routing, repack and migration see the load."""
    start_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    response_len: Literal["natural", "lognormal", "pareto"] = "natural"
    len_median: float = 16.0
    len_sigma: float = 1.0
    """lognormal: σ of log-length; pareto: the shape α (smaller: heavier tail)."""
    len_max: int = 96

    def __post_init__(self):
        _positive(self, "num_servers", "max_num_seqs", "groups_per_batch", "start_timeout_s",
                  "request_timeout_s", "len_median", "len_sigma", "len_max")
        _check(0 < self.kv_memory_fraction < 1, "RolloutConfig", "kv_memory_fraction",
               self.kv_memory_fraction, "must be in (0, 1)")
        _check(self.kv_capacity_tokens >= 0, "RolloutConfig", "kv_capacity_tokens",
               self.kv_capacity_tokens, "must be >= 0 (0: the server's own)")
        _check(self.response_len in ("natural", "lognormal", "pareto"), "RolloutConfig",
               "response_len", self.response_len, "must be natural, lognormal or pareto")


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """The rollout coordinator (fnrl.policy.cycle): staleness bound, routing, sync,
    migration, repack, balancing. Presets (fnrl.experiments.presets) set these."""

    eta: int = 1
    """Staleness bound η: every trained token satisfies V_token + η ≥ V_trainer."""
    stuck_timeout_s: float = 0.0
    """Abort the unfinished groups of a head buffer Stuck this long (0: never)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    cost: CostModel = field(default_factory=CostModel)
    cost_file: str = ""
    """JSON written by `python -m fnrl.policy.profile_cost` ("auto": the model directory's
    cost_model.json), loaded into `cost` at start; the run's config.json keeps the values."""
    sampler: str = "fifo"
    """Which rewarded groups a Consume trains when more than a batch are ready:
    fnrl.data.experience.SAMPLERS ("fifo": arrival order; "oldest_version")."""
    use_repack: bool = False
    repack: RepackConfig = field(default_factory=RepackConfig)
    use_balance: bool = False
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    pool_fsync: bool = False
    """fsync every partial-response record (survives power loss, not just a crash)."""

    def __post_init__(self):
        _check(self.eta >= 0, "CoordinatorConfig", "eta", self.eta, "must be >= 0")
        _check(self.stuck_timeout_s >= 0, "CoordinatorConfig", "stuck_timeout_s",
               self.stuck_timeout_s, "must be >= 0 (0: off)")
        _check(self.sampler in SAMPLERS, "CoordinatorConfig", "sampler", self.sampler,
               f"must be one of {sorted(SAMPLERS)}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole job. `preset` names the ablation preset the other fields started from
    (fnrl.experiments.presets); the command line overrides any of them."""

    preset: str = ""
    steps: int = 60
    eval_every: int = 10
    seed: int = 0
    run_dir: str = ""
    resume: bool = True
    trainer_timeout_s: float = 600.0
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    coord: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self):
        _positive(self, "steps", "eval_every", "trainer_timeout_s")

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
