"""The config tree: keyword-only frozen dataclasses, validated where they are built.

A leaf of the import graph: nothing here imports from the rest of fnrl, so every
layer may read its config. Every invalid value raises a ValueError naming the field
and the value (`check`), so a bad command line fails before any process starts. The
command line is parsed by `tyro` from these classes, which also rejects unknown keys
by name. Registered names (loss terms, samplers, ...) are kept here as tuples; tests
keep them equal to the registries' built-in keys, and a loss term or advantage a user
registers (fnrl.losses.register) is added through `accept_name`.
"""

from fnrl.config.algo import (ADVANTAGE_NAMES, AGGREGATION_NAMES, CORRECTION_NAMES,
                              KL_ESTIMATOR_NAMES, LOSS_TERM_NAMES, POLICY_TERM_NAMES,
                              AlgoConfig, accept_name, known_names)
from fnrl.config.base import check, finite, from_dict, load_json, positive, save_json, to_dict
from fnrl.config.cluster import ClusterConfig
from fnrl.config.distributed import DistributedConfig
from fnrl.config.coord import (SAMPLER_NAMES, SYNC_MODES, BalanceConfig, CoordinatorConfig,
                               CostModel, RepackConfig, RoutingConfig)
from fnrl.config.eval import EVAL_SERVERS, EvalConfig
from fnrl.config.faults import FaultConfig, FaultInjection, Injection, parse_injection
from fnrl.config.gates import GATE_RULE_NAMES, GatesConfig
from fnrl.config.lora import LORA_TARGETS, LoraConfig
from fnrl.config.relay import MIB, RelayConfig
from fnrl.config.run import (VLLM_HEAD_SIZES, MeshConfig, ModelConfig, RolloutConfig, RunConfig,
                             TaskConfig, TrainerConfig, WarmStartConfig)

__all__ = [
    "ADVANTAGE_NAMES", "AGGREGATION_NAMES", "CORRECTION_NAMES", "KL_ESTIMATOR_NAMES",
    "LOSS_TERM_NAMES", "POLICY_TERM_NAMES", "MIB", "SAMPLER_NAMES", "SYNC_MODES", "VLLM_HEAD_SIZES", "AlgoConfig",
    "BalanceConfig", "ClusterConfig", "CoordinatorConfig", "CostModel", "DistributedConfig",
    "EVAL_SERVERS", "EvalConfig", "FaultConfig", "FaultInjection", "GATE_RULE_NAMES",
    "GatesConfig",
    "Injection", "LORA_TARGETS", "LoraConfig", "MeshConfig",
    "ModelConfig", "RelayConfig", "RepackConfig", "RolloutConfig", "RoutingConfig", "RunConfig",
    "TaskConfig", "TrainerConfig", "WarmStartConfig", "accept_name", "check", "finite",
    "from_dict", "known_names", "load_json", "parse_injection", "positive", "save_json",
    "to_dict",
]
