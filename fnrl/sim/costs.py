"""The simulator's cost models: small pure functions, parameters in `costs.toml`.

- Decode: StaleFlow's per-step latency L = k1·kv + max(k2, k3·n) + k4 (App. B Eq. 11,
  `fnrl.config.CostModel`), from a named coefficient set (Table 4), from the JSON that
  `python -m fnrl.experiments.profile_cost` fits on a real engine, or derived from the
  model and GPU (`roofline_decode`). Between two events an instance's batch is fixed and
  its KV grows by n tokens a step, so m steps take a closed form (`decode_steps_s`) and
  the simulator never walks single steps.
- Prefill (compute-bound), KV capacity in tokens (HBM left after the weights).
- Colocation's memory (verl): the trainer's FSDP state resident beside the engine, the
  engine's memory share, and the phase switch a step (sleep, wake, optimizer offload).
- Train step: model FLOPs × tokens / (GPUs × peak × MFU), attention included.
- Weight movement: Laminar's publish stall, chain broadcast (App. C: the relay at chain
  position j holds the last of k chunks after (j + k − 1)·t_chunk) and the rollout's
  PCIe pull; against an NCCL broadcast from the trainer and a colocated in-GPU reshard.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from fnrl.config import CostModel
from fnrl.config.base import check, positive
from fnrl.policy.cost_model import stored_cost_model

COSTS_FILE = Path(__file__).with_name("costs.toml")


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    pcie_bw: float
    nic_bw: float
    nvlink_bw: float = 0.0
    """One GPU's NVLink bandwidth each way, bytes/s (0: unknown; needed for `tp_comm`)."""

    def __post_init__(self):
        positive(self, "peak_flops", "hbm_bytes", "hbm_bw", "pcie_bw", "nic_bw")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    params: float
    active_params: float
    layers: int
    attn_dim: int
    kv_bytes_per_token: float
    dtype_bytes: int = 2          # BF16 weights in training and serving

    def __post_init__(self):
        positive(self, "params", "active_params", "kv_bytes_per_token", "dtype_bytes")
        check(self.layers >= 0 and self.attn_dim >= 0, "ModelSpec", "layers/attn_dim",
              (self.layers, self.attn_dim), "must be >= 0")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class RooflineParams:
    hbm_efficiency: float = 0.7
    decode_mfu: float = 0.5
    step_overhead_s: float = 4e-3
    prefill_mfu: float = 0.5
    kv_memory_fraction: float = 0.9

    def __post_init__(self):
        positive(self, "hbm_efficiency", "decode_mfu", "prefill_mfu", "kv_memory_fraction")


@dataclass(frozen=True, kw_only=True)
class SyncParams:
    push_bw: float = 100e9
    hop_bw: float = 100e9
    hop_start_s: float = 5e-6
    chunk_bytes: float = 32 * 2**20
    reload_s: float = 0.3
    nccl_bw: float = 25e9
    nccl_setup_s: float = 1.0
    colocated_bw: float = 300e9

    def __post_init__(self):
        positive(self, "push_bw", "hop_bw", "chunk_bytes", "nccl_bw", "colocated_bw")


@dataclass(frozen=True, kw_only=True)
class TrainParams:
    mfu: float = 0.35
    logprob_forward: bool = True

    def __post_init__(self):
        check(0 < self.mfu <= 1, "TrainParams", "mfu", self.mfu, "must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class ColocatedParams:
    state_bytes_per_param: float = 16.0
    offload_bytes_per_param: float = 12.0
    sleep_level: int = 1

    def __post_init__(self):
        positive(self, "state_bytes_per_param")
        check(0 <= self.offload_bytes_per_param <= self.state_bytes_per_param, "ColocatedParams",
              "offload_bytes_per_param", self.offload_bytes_per_param,
              f"must be in [0, state_bytes_per_param={self.state_bytes_per_param}]")
        check(self.sleep_level in (1, 2), "ColocatedParams", "sleep_level", self.sleep_level,
              "must be 1 (weights to host) or 2 (weights dropped)")


@dataclass(frozen=True, kw_only=True)
class TpCommParams:
    allreduce_intra_s: float = 10e-6
    allreduce_inter_s: float = 50e-6
    allreduce_efficiency: float = 0.8

    def __post_init__(self):
        positive(self, "allreduce_intra_s", "allreduce_inter_s", "allreduce_efficiency")


@dataclass(frozen=True, kw_only=True)
class DecodeCosts:
    """One rollout instance's engine: the decode model plus prefill and per-request
    costs (the extra terms `profile_cost` fits beside it)."""

    cost: CostModel
    prefill_s_per_token: float = 0.0
    per_request_s: float = 0.0
    servers: int = 1
    """How many servers were generating side by side on the host when it was measured
    (`profile_cost --servers`): on a shared CPU host (ClusterSpec.shared_cores) the
    costs are those of one server beside servers - 1 others, and the host's slowdowns
    are taken relative to that many."""


def load_table(path: Path | None = None, *, user: str | Path | None = None) -> dict:
    """The cost tables (`path`, by default the built-in costs.toml), with a user's own TOML
    file merged over them: a [gpu.NAME], [model.NAME] or [decode.NAME] of a new name is
    added and must be complete; one of a known name, and a [roofline]-like section, keeps
    the fields the user's file leaves out. Every entry the user's file touches is checked
    by building its spec, and a malformed one raises a ValueError naming the file and key."""
    table = tomllib.loads((path or COSTS_FILE).read_text())
    if user is None:
        return table
    try:
        extra = tomllib.loads(Path(user).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"costs file {str(user)!r}: {err}") from None
    # Named entries per kind, and the one-table sections, each with the spec that checks it.
    named = {"gpu": GpuSpec, "model": ModelSpec, "decode": CostModel}
    single = {"roofline": RooflineParams, "sync": SyncParams, "train": TrainParams,
              "colocated": ColocatedParams, "tp_comm": TpCommParams, "commands": CommandCosts}
    for kind, entries in extra.items():
        if kind not in table and kind not in named:
            raise ValueError(f"costs file {str(user)!r}: unknown section [{kind}]; the sections "
                             f"are {sorted(set(table) | set(named))}")
        if not isinstance(entries, dict):
            raise ValueError(f"costs file {str(user)!r}: {kind} must be a table, got {entries!r}")
        base = table.setdefault(kind, {})
        items = entries.items() if kind in named else [(None, entries)]
        for name, fields in items:
            key = kind if name is None else f'{kind}."{name}"'
            if not isinstance(fields, dict):
                raise ValueError(f"costs file {str(user)!r}: [{key}] must be a table of fields, "
                                 f"got {fields!r}")
            merged = {**(base if name is None else base.get(name, {})), **fields}
            spec = named.get(kind) or single.get(kind)
            # Every spec's field is a number or a flag; a spec's own checks may not say which.
            wrong = [f for f, v in fields.items() if not isinstance(v, (int, float))]
            if spec is not None and wrong:
                raise ValueError(f"costs file {str(user)!r}: [{key}] {wrong[0]} = "
                                 f"{fields[wrong[0]]!r} must be a number")
            try:
                if spec is not None:
                    spec(**merged)
            except (TypeError, ValueError) as err:
                raise ValueError(f"costs file {str(user)!r}: [{key}] is malformed: {err}") from None
            if name is None:
                table[kind] = merged
            else:
                base[name] = merged
    return table


def _named(table: dict, kind: str, name: str) -> dict:
    if name not in table.get(kind, {}):
        raise ValueError(f"invalid config {kind}={name!r}: must be one of "
                         f"{sorted(table.get(kind, {}))} (fnrl/sim/costs.toml)")
    return table[kind][name]


def gpu_spec(name: str, table: dict | None = None) -> GpuSpec:
    return GpuSpec(**_named(table or load_table(), "gpu", name))


def model_spec(name: str, table: dict | None = None) -> ModelSpec:
    return ModelSpec(**_named(table or load_table(), "model", name))


def named_decode(name: str, table: dict | None = None) -> CostModel:
    return CostModel(**_named(table or load_table(), "decode", name))


def load_profiled(path: str | Path) -> DecodeCosts:
    """The JSON `python -m fnrl.experiments.profile_cost` writes (k1..k5, and the
    prefill and per-request terms it fits beside them when present)."""
    data = json.loads(Path(path).read_text())
    cost = stored_cost_model(data, path)
    servers = data.get("engine", {}).get("servers", 1)
    if type(servers) is not int or servers < 1:
        raise ValueError(f"cost file {str(path)!r}: engine.servers={servers!r} must be an "
                         "integer >= 1 (the servers generating side by side when profiled)")
    return DecodeCosts(cost=cost, prefill_s_per_token=float(data.get("prefill_s_per_token", 0.0)),
                       per_request_s=float(data.get("per_request_s", 0.0)), servers=servers)


@dataclass(frozen=True, kw_only=True)
class Corun:
    """How much the roles of one shared CPU host slow each other, measured together
    (lab/benchmarks/corun.py): `trainer[k]`, the trainer's steady step beside k generating
    servers over its time alone; `server[(k, trainer)]`, a server's decode with k servers
    generating (itself included), the trainer stepping or not, over one server alone."""

    trainer: dict
    server: dict

    def trainer_factor(self, servers: int) -> float:
        return self.trainer[min(servers, max(self.trainer))] if servers else 1.0

    def server_factor(self, servers: int, trainer: bool) -> float:
        k = min(max(servers, 1), max(k for k, _ in self.server))
        return self.server[(k, trainer)]


def load_corun(path: str | Path) -> Corun:
    """The JSON `lab/benchmarks/corun.py --out PATH` writes."""
    data = json.loads(Path(path).read_text())
    try:
        trainer = {int(k): float(v["slowdown"]) for k, v in data["trainer_slowdown"].items()}
        server = {(1, False): 1.0}
        for key, v in data["server_slowdown"].items():
            k, _, with_trainer = key.partition("+")
            server[(int(k), bool(with_trainer))] = float(v["slowdown"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"co-run file {str(path)!r}: not lab/benchmarks/corun.py's table "
                         f"({err!r})") from None
    counts = sorted({k for k, _ in server})
    missing = [key for key in ((k, t) for k in counts for t in (False, True)) if key not in server]
    if not trainer or missing or sorted(trainer) != counts:
        raise ValueError(f"co-run file {str(path)!r}: needs the trainer beside 1..N servers and "
                         f"each server count with and without it; has trainer {sorted(trainer)}, "
                         f"servers {sorted(server)}")
    return Corun(trainer=trainer, server=server)


# --- decode -------------------------------------------------------------------------------


def step_s(cost: CostModel, kv: float, n: int) -> float:
    """One decode step with n running trajectories holding kv KV tokens (Eq. 11)."""
    return cost.k1 * cost.k5 * kv + max(cost.k2, cost.k3 * n) + cost.k4


def decode_steps_s(cost: CostModel, kv0: float, n: int, m: int) -> float:
    """m consecutive steps of a fixed batch of n that holds kv0 tokens before the first
    and adds n tokens each step: Σ_{j<m} L(kv0 + n·j, n)."""
    return m * step_s(cost, kv0, n) + cost.k1 * cost.k5 * n * m * (m - 1) / 2.0


def steps_within(cost: CostModel, kv0: float, n: int, dt: float) -> int:
    """The most whole steps that end within dt (inverse of `decode_steps_s`)."""
    if dt <= 0 or n <= 0:
        return 0
    a = cost.k1 * cost.k5 * n / 2.0
    b = step_s(cost, kv0, n) - a
    m = dt / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)
    m = max(int(m), 0)
    # The root is exact up to rounding: settle it on the integers.
    while m > 0 and decode_steps_s(cost, kv0, n, m) > dt:
        m -= 1
    while decode_steps_s(cost, kv0, n, m + 1) <= dt:
        m += 1
    return m


def tp_allreduce_s(model: ModelSpec, gpu: GpuSpec, tp: int, gpus_per_machine: int,
                   p: TpCommParams) -> tuple[float, float]:
    """(per step, per sequence) seconds of a decode step's tensor-parallel all-reduces:
    Megatron-style, two a layer (after attention and after the MLP), each of one hidden
    vector per sequence, ring-reduced: latency + 2(tp − 1)/tp · bytes / bandwidth. Within
    a machine over NVLink; an instance wider than a machine crosses the network on every
    one (LlamaRL §4.3: mp > 8), at the NIC's bandwidth and a larger latency. The hidden
    size is taken as attn_dim (exact for the dense Qwen2.5 and Llama 3.1 models)."""
    if tp <= 1:
        return 0.0, 0.0
    inside = tp <= gpus_per_machine
    bw = gpu.nvlink_bw if inside else gpu.nic_bw
    check(bw > 0, "GpuSpec", "nvlink_bw" if inside else "nic_bw", bw,
          "must be > 0 to model tensor-parallel all-reduces (cluster.tp_comm)")
    calls = 2 * model.layers
    per_seq = 2.0 * (tp - 1) / tp * model.attn_dim * model.dtype_bytes / (bw * p.allreduce_efficiency)
    latency = p.allreduce_intra_s if inside else p.allreduce_inter_s
    return calls * latency, calls * per_seq


def tp_comm_params(table: dict | None = None, allreduce_inter_s: float = 0.0) -> TpCommParams:
    """The table's [tp_comm]; `allreduce_inter_s` > 0 replaces its cross-machine latency
    (ClusterSpec.allreduce_inter_s: what a given engine pays)."""
    table = load_table() if table is None else table
    p = TpCommParams(**table.get("tp_comm", {}))
    return replace(p, allreduce_inter_s=allreduce_inter_s) if allreduce_inter_s > 0 else p


def roofline_decode(model: ModelSpec, gpu: GpuSpec, tp: int, p: RooflineParams,
                    comm: tuple[float, float] = (0.0, 0.0)) -> DecodeCosts:
    """Eq. 11's coefficients from first principles for one instance of `tp` GPUs:
    k1 reads one KV token, k2 reads every weight once (an MoE at a large batch touches
    all experts), k3 is one sequence's matmul FLOPs past the roofline, k4 the fixed
    per-step overhead; prefill is compute-bound at prefill_mfu. `comm` is
    `tp_allreduce_s`'s (per step, per sequence): the latency adds to k4 and the bytes to
    k3 (Eq. 11 has no additive per-sequence term, so below the roofline batch k2/k3 the
    bytes hide under the weight reads: a gap of at most the bytes' time at that batch)."""
    bw = tp * gpu.hbm_bw * p.hbm_efficiency
    fixed, per_seq = comm
    cost = CostModel(k1=model.kv_bytes_per_token / bw, k2=model.weight_bytes / bw,
                     k3=2 * model.active_params / (tp * gpu.peak_flops * p.decode_mfu) + per_seq,
                     k4=p.step_overhead_s + fixed, k5=1.0)
    prefill = 2 * model.active_params / (tp * gpu.peak_flops * p.prefill_mfu)
    return DecodeCosts(cost=cost, prefill_s_per_token=prefill)


def kv_capacity_tokens(model: ModelSpec, gpu: GpuSpec, tp: int, p: RooflineParams) -> int:
    """KV tokens one instance holds: its share of HBM (vLLM's memory utilisation) less
    the weights."""
    free = tp * gpu.hbm_bytes * p.kv_memory_fraction - model.weight_bytes
    if free <= 0:
        raise ValueError(f"invalid config tp={tp}: {model.weight_bytes / 1e9:.0f} GB of weights "
                         f"do not fit in {tp} x {gpu.hbm_bytes / 1e9:.0f} GB")
    return int(free // model.kv_bytes_per_token)


# --- training -------------------------------------------------------------------------------


def train_flops(model: ModelSpec, seq_lens, *, logprob_forward: bool) -> float:
    """Forward + backward FLOPs of one step: 6·N per token (Kaplan et al.) plus causal
    attention, 3 × (2·layers·attn_dim·ctx per token, ctx averaging len/2) = 3·L·d·len²
    per sequence; one more forward (a third) for the old log-probs."""
    total = sum(seq_lens)
    squares = sum(n * n for n in seq_lens)
    flops = 6.0 * model.active_params * total + 3.0 * model.layers * model.attn_dim * squares
    return flops * (4.0 / 3.0 if logprob_forward else 1.0)


def train_step_s(model: ModelSpec, gpu: GpuSpec, gpus: int, seq_lens, p: TrainParams) -> float:
    return train_flops(model, seq_lens, logprob_forward=p.logprob_forward) / (
        gpus * gpu.peak_flops * p.mfu)


# --- weight movement --------------------------------------------------------------------------


def publish_stall_s(nbytes: float, p: SyncParams) -> float:
    """Laminar step ①: the trainer pushes to the master relay, then resumes."""
    return nbytes / p.push_bw


def chain_chunk_s(nbytes: float, p: SyncParams) -> tuple[int, float]:
    """(k, t_chunk): chunk count and one hop of one chunk (App. C)."""
    k = max(1, math.ceil(nbytes / p.chunk_bytes))
    return k, (nbytes / k) / p.hop_bw + p.hop_start_s


def chain_arrival_s(nbytes: float, position: int, p: SyncParams) -> float:
    """When the relay at chain `position` (0: the master) holds the whole version,
    after the master has it. The last relay of p gets it at (p + k − 2)·t_chunk,
    App. C Eq. 1."""
    if position <= 0:
        return 0.0
    k, t_chunk = chain_chunk_s(nbytes, p)
    return (position + k - 1) * t_chunk


def relay_pull_s(nbytes: float, tp: int, gpu: GpuSpec, p: SyncParams) -> float:
    """Laminar step ③: each of the instance's GPUs loads its shard over PCIe."""
    return nbytes / tp / gpu.pcie_bw + p.reload_s


def nccl_sync_s(nbytes: float, tp: int, p: SyncParams) -> float:
    """A trainer → rollout NCCL broadcast (verl-style global sync): gather and reshard
    on the trainer, then each GPU receives its shard; the trainer waits for it all."""
    return p.nccl_setup_s + nbytes / tp / p.nccl_bw


def colocated_sync_s(nbytes: float, tp: int, p: SyncParams) -> float:
    """Colocated: the train layout is resharded into the engine's on the same GPUs."""
    return nbytes / tp / p.colocated_bw + p.reload_s


# --- colocation's memory ---------------------------------------------------------------------


def colocated_memory(model: ModelSpec, served: ModelSpec, gpu: GpuSpec, *, tp: int, gpus: int,
                     fraction: float, offload: bool, roof: RooflineParams,
                     p: ColocatedParams) -> tuple[float, float]:
    """verl's colocation, per GPU: (the engine's memory fraction, the phase switch's
    seconds a step).

    The trainer's FSDP state (`state_bytes_per_param`: BF16 weights and gradients, FP32
    master weights and Adam's two moments, ZeRO §3's 16 bytes) is sharded over all `gpus`
    and stays resident while the engine generates, less the optimizer state that
    `offload` moves to host. `fraction` is vLLM's `gpu_memory_utilization` (verl's
    default is 0.5); 0 gives the engine what the resident state leaves of the roofline's
    `kv_memory_fraction`. A step switches phases twice: the engine sleeps before the
    train step (level 1: its weights go to host over PCIe; level 2: dropped, as the
    reshard rewrites them) and wakes after it, and offloaded optimizer state comes back
    for the step and leaves after it.

    Gap (ours): the seeds do not give verl's offload or sleep settings; 16 bytes a
    parameter is the standard mixed-precision Adam figure, and activations, freed before
    generation, are left out."""
    resident = (p.state_bytes_per_param - (p.offload_bytes_per_param if offload else 0.0)) \
        * model.params / gpus
    engine = fraction or roof.kv_memory_fraction - resident / gpu.hbm_bytes
    if resident + engine * gpu.hbm_bytes > gpu.hbm_bytes * (1 + 1e-9) or engine <= 0:
        raise ValueError(
            f"invalid config colocated on {gpus} GPUs: the trainer's resident state "
            f"({resident / 1e9:.1f} GB a GPU) and the engine's share "
            f"({max(engine, 0.0):.2f} x {gpu.hbm_bytes / 1e9:.0f} GB) do not fit in one GPU"
            + ("" if offload else "; try cluster.train_offload=true"))
    weights = served.weight_bytes / tp / gpu.pcie_bw if p.sleep_level == 1 else 0.0
    moved = p.offload_bytes_per_param * model.params / gpus / gpu.pcie_bw if offload else 0.0
    return engine, 2 * (weights + moved)


# --- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CommandCosts:
    """What executing one command costs (costs.toml [commands], issue 38): the controller's
    cycle and RPC before a command lands on an engine, and the engine's own work for it."""

    decide_s: float = 8e-3
    """The controller's decide a cycle: every command it issues lands after it."""
    rpc_s: float = 5e-4
    """One controller → engine request (Route, Migrate's destination, Pull)."""
    admit_s: float = 1e-3
    """An engine's work to admit one request, where the decode profile has no
    `per_request_s` of its own."""
    abort_s: float = 1e-4
    """An engine's work to drop one request (Interrupt, Migrate's source, Abort): it
    leaves the scheduler and its KV blocks are freed between two steps."""
    block_tokens: int = 16
    """KV block size: the prefix cache hits whole blocks only."""
    lookup_s_per_block: float = 1e-6
    """Hashing and looking up one block of a request's context on admission."""

    def __post_init__(self):
        for name in ("decide_s", "rpc_s", "admit_s", "abort_s", "lookup_s_per_block"):
            check(getattr(self, name) >= 0, "CommandCosts", name, getattr(self, name), "must be >= 0")
        positive(self, "block_tokens")

    @property
    def land_s(self) -> float:
        """From a cycle's start until a command it issues reaches its engine."""
        return self.decide_s + self.rpc_s


def command_costs(table: dict | None = None) -> CommandCosts | None:
    """The table's [commands]; None (commands cost nothing) when the table has none."""
    table = load_table() if table is None else table
    return CommandCosts(**table["commands"]) if "commands" in table else None


def cached_prefill_tokens(ctx: int, hit: int, block_tokens: int) -> int:
    """Tokens an admission prefills when `hit` tokens of its `ctx` are cached: the cache
    serves whole blocks only, and a full hit still computes the last token (the request
    needs its logits)."""
    hit = min(hit - hit % block_tokens, ctx - 1)
    return ctx - max(hit, 0)
