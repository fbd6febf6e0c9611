"""The config tree's root (`RunConfig`) and the model, task, trainer and rollout parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fnrl.config.algo import AlgoConfig
from fnrl.config.base import check, finite, positive
from fnrl.config.cluster import ClusterConfig
from fnrl.config.distributed import DistributedConfig
from fnrl.config.eval import EvalConfig
from fnrl.config.coord import CoordinatorConfig
from fnrl.config.faults import FaultConfig
from fnrl.config.gates import GatesConfig
from fnrl.config.lora import LoraConfig
from fnrl.config.relay import RelayConfig
from fnrl.config.sandbox import SandboxConfig

TRAIN_DTYPES = ("float32", "bfloat16")
ATTENTION_KERNELS = ("xla", "cudnn")
REMAT_POLICIES = ("none", "dots", "full")
MATMUL_PRECISIONS = ("default", "high", "highest")
SERVE_DTYPES = ("float32", "bfloat16", "float16")
ROUTING_REPLAY = ("off", "replay")

# Head sizes vLLM's CPU attention backend accepts (vllm 0.32 cpu_attn.py); GPU backends
# accept these too.
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The reward (fnrl.data.reward): 1 for a correct final answer, else 0, plus these
    optional terms, each off by default."""

    format_weight: float = 0.0
    """Added when the response states its answer with a marker (`#### x` or `\\boxed{x}`),
    right or wrong."""
    number_fallback: bool = True
    """A response without a marker is graded on its last number (False: it scores 0)."""
    length_cost: float = 0.0
    """Subtracted per response token. (DAPO's overlong penalty is algo.overlong_buffer.)"""

    def __post_init__(self):
        name = "RewardConfig"
        for field_name in ("format_weight", "length_cost"):
            value = getattr(self, field_name)
            check(finite(value) and value >= 0, name, field_name, value,
                  "must be a finite number >= 0")


# The built-in environments of fnrl.envs (config may not import the registry;
# tests/envs/test_env_registry.py keeps this equal to its built-in keys). One a user
# registers (fnrl.envs.base.register_env) is added through `accept_env_name`.
ENV_NAMES = ("math", "tool_arith")
_REGISTERED_ENVS: set[str] = set()


def accept_env_name(name: str) -> None:
    """Lets `TaskConfig.env` name an environment registered at run time."""
    _REGISTERED_ENVS.add(name)


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The prompts: the synthetic arithmetic task (fnrl.data.arith), or JSONL / Parquet
    files (fnrl.data.dataset) when `dataset` names one; how a prompt becomes token ids
    (fnrl.data.tokenizer) and how a response is graded (fnrl.data.answers, .reward)."""

    seed: int = 1234
    num_eval: int = 256
    min_level: int = 1
    max_level: int = 3
    dataset: str = ""
    """A .jsonl or .parquet file of training rows; empty: the synthetic task."""
    eval_dataset: str = ""
    """A .jsonl or .parquet file of eval rows; empty: num_eval rows of `dataset` are held
    out instead."""
    prompt_key: str = "prompt"
    """The row's prompt field; a dotted path reads a nested object ("extra.question")."""
    answer_key: str = "answer"
    """The row's answer field (dotted like prompt_key, e.g. "reward_model.ground_truth")."""
    answer_format: Literal["auto", "gsm8k", "boxed", "raw"] = "auto"
    """How the gold answer is read from the answer field: gsm8k: the text after its last
    "####"; boxed: its last \\boxed{...}; raw: the whole field; auto: gsm8k if the field
    has "####", else boxed if it has \\boxed, else raw."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """skip: a malformed row is skipped and recorded in bad_rows.jsonl; error: stop."""
    chat_template: Literal["auto", "none"] = "auto"
    """auto: the tokenizer's chat template when it has one; none: BOS (if any) + the text."""
    system_prompt: str = ""
    """The chat's system message; empty: none (the template may insert its own default)."""
    prompt_format: str = "{prompt}"
    """The user message, "{prompt}" standing for the row's prompt (plain substitution, so
    braces elsewhere are literal), e.g. "{prompt}\\nPlease reason step by step, and put
    your final answer within \\boxed{}."."""
    stop_tokens: tuple[str, ...] = ()
    """Tokens that also end generation, beside the tokenizer's EOS and the eos ids of the
    model's generation_config.json (e.g. "<|im_end|>" "<|endoftext|>")."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: str = "math"
    """The environment a trajectory runs in (fnrl.envs, by registered name): "math",
    single-turn generation graded by `reward`; "tool_arith", multi-digit products with a
    calculator tool over several turns (fnrl.control.episodes; its prompts come from
    fnrl.data.tool_arith unless task.dataset names a file)."""

    def __post_init__(self):
        positive(self, "num_eval")
        known = ENV_NAMES + tuple(sorted(_REGISTERED_ENVS - set(ENV_NAMES)))
        check(self.env in known, "TaskConfig", "env", self.env,
              f"must be a registered environment: {', '.join(known)}")
        check(1 <= self.min_level <= self.max_level <= 3, "TaskConfig", "min_level..max_level",
              (self.min_level, self.max_level),
              "need 1 <= min_level <= max_level <= 3 (1: a+b, 2: a-b, 3: a*d)")
        check(self.on_bad_row in ("skip", "error"), "TaskConfig", "on_bad_row", self.on_bad_row,
              "must be 'skip' or 'error'")
        check(not self.eval_dataset or self.dataset, "TaskConfig", "eval_dataset",
              self.eval_dataset, "needs task.dataset (the synthetic task has its own eval split)")
        for name in ("prompt_key", "answer_key"):
            check(bool(getattr(self, name)), "TaskConfig", name, getattr(self, name),
                  "must name a field")
        check(self.prompt_key != self.answer_key, "TaskConfig", "answer_key", self.answer_key,
              "must differ from prompt_key")
        check(self.answer_format in ("auto", "gsm8k", "boxed", "raw"), "TaskConfig",
              "answer_format", self.answer_format, "must be auto, gsm8k, boxed or raw")
        check(self.chat_template in ("auto", "none"), "TaskConfig", "chat_template",
              self.chat_template, "must be 'auto' or 'none'")
        check(self.prompt_format.count("{prompt}") == 1, "TaskConfig", "prompt_format",
              self.prompt_format, "must contain '{prompt}' exactly once")
        object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))
        check(all(isinstance(t, str) and t for t in self.stop_tokens), "TaskConfig",
              "stop_tokens", self.stop_tokens, "must be non-empty token strings")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train. `model_dir` empty means the embedded tiny default."""

    model_dir: str = ""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 384
    num_experts: int = 0
    """0: the embedded default is dense (Qwen2); > 0: a Qwen3-MoE with this many experts
    in every layer, `num_experts_per_tok` of them per token, each `moe_intermediate_size`
    wide. Ignored with `model_dir` (the directory's config.json says)."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 96
    routing_replay: str = "off"
    """A mixture of experts' rollout routing replay (R3, arXiv 2510.11370): "replay" has
    the trainer route each token to the experts the inference engine chose for it (the
    engine reports them: vLLM's --enable-return-routed-experts); "off": its own router."""
    seed: int = 0
    max_seq_len: int = 0
    """Longest sequence (prompt + response) the trainer compiles for and the servers are
    started with; 0: the model's max_position_embeddings. Read it through `context_len`."""

    def __post_init__(self):
        positive(self, "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        check(self.num_experts >= 0, "ModelConfig", "num_experts", self.num_experts,
              "must be >= 0 (0: a dense model)")
        if self.num_experts:
            positive(self, "num_experts_per_tok", "moe_intermediate_size")
            check(self.num_experts_per_tok <= self.num_experts, "ModelConfig",
                  "num_experts_per_tok", self.num_experts_per_tok,
                  f"must be at most num_experts={self.num_experts}")
        check(self.routing_replay in ROUTING_REPLAY, "ModelConfig", "routing_replay",
              self.routing_replay, f"must be one of {ROUTING_REPLAY}")
        # The embedded default's shape is known here; a model_dir's is checked at start.
        check(self.routing_replay == "off" or self.model_dir or self.num_experts > 0,
              "ModelConfig", "routing_replay", self.routing_replay,
              "a dense model has no routes to replay (set num_experts > 0)")
        check(self.max_seq_len >= 0, "ModelConfig", "max_seq_len", self.max_seq_len,
              "must be >= 0 (0: the model's max_position_embeddings)")
        check(self.num_attention_heads % self.num_key_value_heads == 0, "ModelConfig",
              "num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")
        head_dim = self.hidden_size // self.num_attention_heads
        check(head_dim in VLLM_HEAD_SIZES, "ModelConfig", "hidden_size/num_attention_heads",
              head_dim, f"vLLM's attention kernels support head sizes {VLLM_HEAD_SIZES}")

    def context_len(self, max_position_embeddings: int) -> int:
        """The run's effective context: max_seq_len capped by the model's own
        max_position_embeddings (config.json's, for `model_dir` models)."""
        check(self.max_seq_len <= max_position_embeddings, "ModelConfig", "max_seq_len",
              self.max_seq_len, f"exceeds the model's max_position_embeddings="
              f"{max_position_embeddings}")
        return self.max_seq_len or max_position_embeddings


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Short supervised phase that makes the embedded model sometimes right.

    The demonstrations are worked solutions (fnrl.data.arith) from an imperfect teacher:
    a fraction `demo_error_rate` of them end with an answer line carrying a stray
    trailing "0" (a systematic habit, like the formatting slips SFT data carries into
    real models). Greedy decoding inherits the habit, while sampling still often stops at
    the right place, so the verifiable reward has something to correct and the
    warm-started policy is sometimes right. A step trains on `batch_size` rows of the
    model's length, each packed with whole demonstrations.
    """

    steps: int = 800
    batch_size: int = 16
    learning_rate: float = 3e-3
    demo_error_rate: float = 0.6
    tool_call_rate: float = 0.3
    """With `task.env tool_arith`, the warm start's demonstrations are the tool task's
    (fnrl.data.tool_arith.demonstration): this fraction calls the calculator and copies
    its result, `tool_bad_call_rate` misspells the call's closing tag (the environment
    answers with an error) and guesses, and the rest guess without a call, so greedy decoding starts
    out guessing and RL has tool use to learn."""
    tool_bad_call_rate: float = 0.1
    cache_dir: str = "~/.cache/fnrl/models"

    def __post_init__(self):
        positive(self, "steps", "batch_size", "learning_rate")
        check(0.0 <= self.demo_error_rate < 1.0, "WarmStartConfig", "demo_error_rate",
              self.demo_error_rate, "must be in [0, 1)")
        for name in ("tool_call_rate", "tool_bad_call_rate"):
            check(0.0 <= getattr(self, name) <= 1.0, "WarmStartConfig", name,
                  getattr(self, name), "must be in [0, 1]")
        check(self.tool_call_rate + self.tool_bad_call_rate <= 1.0, "WarmStartConfig",
              "tool_call_rate", self.tool_call_rate,
              f"plus tool_bad_call_rate={self.tool_bad_call_rate} must be at most 1")


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Trainer mesh shape over axes ("data", "fsdp", "tensor"); data=-1 takes the rest."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        check(self.data == -1 or self.data > 0, "MeshConfig", "data", self.data,
              "must be -1 (all remaining devices) or > 0")
        positive(self, "fsdp", "tensor")


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
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """The trainer's processes on one global mesh (1 process by default)."""
    logprob_chunk: int = 2048
    """Tokens whose vocabulary logits exist at once when computing log-probs and entropy
    (rows x positions per chunk; fnrl.trainer.logprobs, a fused chunked logsumexp with its
    own backward); 0: all of a micro-batch's at once (B x T x V floats: 5 GB for 8 x 1,024
    tokens of a 151,936-token vocabulary), kept for parity tests."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weights and Adam moments (float32: mixed precision keeps them there)."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Activations and matmuls; log-probs, softmax statistics and the loss are float32
    whatever it is. auto: bfloat16 on GPU, float32 on CPU (fnrl.trainer.platform)."""
    remat: Literal["auto", "none", "dots", "full"] = "auto"
    """What each decoder layer keeps for the backward pass (fnrl.models.decoder
    REMAT_POLICIES): none keeps every activation; dots keeps the weight matmuls' outputs
    and the attention output and recomputes the elementwise work; full keeps only each
    layer's input. auto: none on CPU; on GPU dots, or full when the memory plan of dots
    does not fit the card. True/False (older configs) read as full/none."""
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    """Attention kernel (fnrl.models.attention): xla (einsum, any platform) or cudnn
    (fused flash attention, GPU, bfloat16). auto: cudnn where it can run, else xla."""
    matmul_precision: Literal["auto", "default", "high", "highest"] = "auto"
    """jax.default_matmul_precision of the step. auto: highest for float32 compute (no
    TF32 on GPU: float32 means float32 everywhere), default for bfloat16."""
    pack_max_segments: int = 64
    """Packed rows (pack_rows > 0) hold at most this many runs: sequences, and the
    padding tail. The attention kernels are built for it (cuDNN's packed layout takes a
    static number of segments per row)."""
    cpu_threads: int = 0
    """CPUs (and so XLA intra-op threads) the trainer process runs on; 0 = all allowed.
    On a host shared with vLLM servers, fewer threads than cores avoids waiting on
    descheduled pool threads (fnrl.trainer.xla_flags)."""
    checkpoint_every: int = 1
    """Save the TrainState every this many versions. Between saves every trained batch is
    logged, so a restarted trainer replays them and comes back at the version it had
    (fnrl.trainer.checkpoint)."""
    checkpoint_keep: int = 2
    """Finished checkpoints kept on disk (the oldest are deleted)."""
    call_timeout_s: float = 600.0
    """How long the controller waits for the trainer's answer to one call."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (rank > 0) instead of full fine-tuning (fnrl.models.lora)."""
    gpus_per_process: int = 0
    """GPUs each trainer process gets on the trainer's node (0: none reserved, as on
    CPU). The Ray backend reserves distributed.num_processes x this on the trainer's
    node and makes each process see its own (CUDA_VISIBLE_DEVICES)."""

    def __post_init__(self):
        name = "TrainerConfig"
        positive(self, "micro_batches")
        buckets = tuple(self.length_buckets)
        object.__setattr__(self, "length_buckets", buckets)
        check(all(isinstance(b, int) and b > 1 for b in buckets), name, "length_buckets", buckets,
              "must be ints > 1")
        check(list(buckets) == sorted(set(buckets)), name, "length_buckets", buckets,
              "must be strictly increasing")
        check(self.pack_rows >= 0, name, "pack_rows", self.pack_rows, "must be >= 0")
        check(self.pack_rows % self.micro_batches == 0, name, "pack_rows", self.pack_rows,
              f"must be a multiple of micro_batches={self.micro_batches}")
        check(self.logprob_chunk >= 0, name, "logprob_chunk", self.logprob_chunk,
              "must be >= 0 (0: unchunked)")
        check(self.param_dtype in TRAIN_DTYPES, name, "param_dtype", self.param_dtype,
              f"must be one of {TRAIN_DTYPES}")
        if isinstance(self.remat, bool):   # configs written before remat had policies
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        for field_name, allowed in (("compute_dtype", TRAIN_DTYPES), ("remat", REMAT_POLICIES),
                                    ("attention", ATTENTION_KERNELS),
                                    ("matmul_precision", MATMUL_PRECISIONS)):
            value = getattr(self, field_name)
            check(value in ("auto", *allowed), name, field_name, value,
                  f"must be one of {('auto', *allowed)}")
        check(type(self.pack_max_segments) is int and self.pack_max_segments >= 2, name,
              "pack_max_segments", self.pack_max_segments,
              "must be an int >= 2 (a sequence and a padding tail)")
        positive(self, "checkpoint_every", "checkpoint_keep", "call_timeout_s")
        check(self.cpu_threads >= 0, name, "cpu_threads", self.cpu_threads,
              "must be >= 0 (0: every CPU the process may use)")
        check(type(self.gpus_per_process) is int and self.gpus_per_process >= 0, name,
              "gpus_per_process", self.gpus_per_process, "must be an int >= 0 (0: no GPU)")


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
    kv_memory_fraction: float = 0.0
    """0: each server reserves the KV cache max_num_seqs sequences of the model's length
    need, checked against free memory at start. Else vLLM's --gpu-memory-utilization
    (on CPU: the fraction of total RAM for the whole server process)."""
    queued_groups: int = 16
    """Fresh prompt groups kept waiting in the trajectory server."""
    kv_capacity_tokens: int = 0
    """KV budget per server the coordinator plans with, in tokens (0: the server's own,
    from /metrics: room for max_num_seqs full-length sequences, or with
    kv_memory_fraction a slice of RAM). On CPU that is far above what one core can
    decode; a smaller budget makes routing, repack and migration see the load."""
    start_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    response_len: Literal["natural", "lognormal", "pareto"] = "natural"
    len_median: float = 16.0
    len_sigma: float = 1.0
    """lognormal: σ of log-length; pareto: the shape α (smaller: heavier tail)."""
    len_max: int = 96
    serve_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """What the vLLM servers hold and compute in (their --dtype); the trainer publishes weights in
    it, so a bfloat16 server gets half the bytes through the relays."""
    tensor_parallel_size: int = 1
    """vLLM's --tensor-parallel-size: the GPUs each server (and the evaluation server)
    spans on its node. The Ray backend places each server on a node with that many free
    GPUs and makes it see just those; on a CPU cluster it reserves none."""
    gpu_sleep: bool | None = None
    """When the trainer and the servers share one GPU (the local backend on a machine with
    one GPU; fnrl.policy.gpu_memory): None puts them side by side when that fits, else
    has the servers sleep while the trainer steps (synchronous presets only); True always
    time-shares; False never. Time-sharing is planned but not carried out yet: a job whose
    plan needs it is refused at start (docs/gpu.md)."""

    def __post_init__(self):
        check(type(self.tensor_parallel_size) is int and self.tensor_parallel_size > 0,
              "RolloutConfig", "tensor_parallel_size", self.tensor_parallel_size,
              "must be an int > 0")
        check(self.serve_dtype in SERVE_DTYPES, "RolloutConfig", "serve_dtype", self.serve_dtype,
              f"must be one of {SERVE_DTYPES}")
        positive(self, "num_servers", "max_num_seqs", "queued_groups", "start_timeout_s",
                 "request_timeout_s", "len_median", "len_sigma", "len_max")
        check(0 <= self.kv_memory_fraction < 1, "RolloutConfig", "kv_memory_fraction",
              self.kv_memory_fraction, "must be in [0, 1) (0: sized from the run's need)")
        check(self.kv_capacity_tokens >= 0, "RolloutConfig", "kv_capacity_tokens",
              self.kv_capacity_tokens, "must be >= 0 (0: the server's own)")
        check(self.response_len in ("natural", "lognormal", "pareto"), "RolloutConfig",
              "response_len", self.response_len, "must be natural, lognormal or pareto")
        check(self.gpu_sleep is None or type(self.gpu_sleep) is bool, "RolloutConfig",
              "gpu_sleep", self.gpu_sleep, "must be true, false or null (decided by the plan)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole job. `preset` names the ablation preset the other fields started from
    (fnrl.config.presets); the command line overrides any of them."""

    preset: str = ""
    steps: int = 40
    seed: int = 0
    deterministic: bool = False
    """Repeatable runs (fnrl.policy.seeding): every vLLM request is seeded from `seed` and
    its trajectory's uid, and a Consume's groups are batched in the order they were
    drawn. With the `sync` preset, two runs of one seed on CPU train bit-identical
    parameters. Off by default: per-request generators make vLLM sample each seeded
    request apart from the batch."""
    run_dir: str = ""
    resume: bool = True
    fsync_logs: bool = False
    """fsync every record of the controller's journal and partial response pool (survives
    power loss, not just a crash)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    # The main job's rate decays (cosine to a tenth by the last step): a constant one let
    # the GRPO noise undo the warm start's arithmetic after the slip was gone.
    algo: AlgoConfig = field(default_factory=lambda: AlgoConfig(lr_schedule="cosine",
                                                                lr_end_ratio=0.1))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    coord: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gates: GatesConfig = field(default_factory=GatesConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The tool sandbox of multi-turn tasks (fnrl.sandbox.pool)."""

    def __post_init__(self):
        positive(self, "steps")
        # A decaying learning rate ends at the run's last step, after its warmup.
        check(self.algo.lr_schedule == "constant" or self.steps > self.algo.lr_warmup_steps,
              "RunConfig", "algo.lr_warmup_steps", self.algo.lr_warmup_steps,
              f"must be below steps={self.steps} with algo.lr_schedule={self.algo.lr_schedule!r}")

    @property
    def batch_size(self) -> int:
        return self.algo.group_size * self.algo.groups_per_step
