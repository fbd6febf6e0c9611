"""What the simulated cluster's GPUs do, and what each movement of weights costs: the
trainer/rollout split, each rollout instance's engine (decode cost, KV room) and the
weight sync's stall, chain and load times; plus the pure schedules the simulation
reads off it (stream generation's mini-batches, the steady throughput).

With `ClusterSpec.rollout_modes` (OrchestrRL's switch of parallelism, seed 003 §6.3)
the rollout GPUs carry the instances of every mode: one `RolloutMode` per TP degree,
each over all of the rollout GPUs, of which only the current mode's are up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from fnrl.sim import costs
from fnrl.sim.config import SimConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutMode:
    """The instances of one TP degree over the rollout GPUs."""

    tp: int
    rids: range                        # their rollout ids
    decode: costs.DecodeCosts
    kv_capacity: int
    pull_s: float                      # one instance's load of one version


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """What the cluster's GPUs do, and what each movement of weights costs."""

    train_gpus: int
    rollouts: int                       # instances of every mode
    modes: tuple[RolloutMode, ...]      # the first is the one the run starts in
    relay_position: tuple[int, ...]     # per rollout: its relay's place in the chain
    publish_s: float                    # the trainer's stall after each step
    relay_arrival_s: tuple[float, ...]  # per rollout: a version reaches its relay after the master
    colocated: bool
    model: costs.ModelSpec
    gpu: costs.GpuSpec
    train: costs.TrainParams

    # The starting mode's, which is every rollout's without rollout_modes.
    @property
    def kv_capacity(self) -> int:
        return self.modes[0].kv_capacity

    @property
    def decode(self) -> costs.DecodeCosts:
        return self.modes[0].decode

    @property
    def pull_s(self) -> float:
        return self.modes[0].pull_s


def layout(cfg: SimConfig, table: dict | None = None) -> Layout:
    c, table = cfg.cluster, table or costs.load_table()
    gpu, model = costs.gpu_spec(c.gpu, table), costs.model_spec(c.model, table)
    roof = costs.RooflineParams(**table.get("roofline", {}))
    sync = costs.SyncParams(**table.get("sync", {}))
    colocated = c.placement == "colocated"
    train_gpus = cfg.gpus if colocated else (c.train_gpus or cfg.gpus // 2)
    rollout_gpus = cfg.gpus if colocated else cfg.gpus - train_gpus
    if rollout_gpus // c.rollout_tp < 1 or train_gpus < 1:
        raise ValueError(f"invalid config gpus={cfg.gpus}: {train_gpus} trainer GPUs and "
                         f"{rollout_gpus} rollout GPUs make no rollout of tp={c.rollout_tp}")
    # The rollouts' copy: quantized (LlamaRL's fp8 generator) when rollout_dtype_bytes says so.
    served = dataclasses.replace(model, dtype_bytes=c.rollout_dtype_bytes or model.dtype_bytes)
    # The engine's share of each GPU and, colocated, the phase switch a step.
    share, switch = c.memory_fraction or roof.kv_memory_fraction, 0.0
    if colocated:
        share, switch = costs.colocated_memory(
            model, served, gpu, tp=c.rollout_tp, gpus=cfg.gpus, fraction=c.memory_fraction,
            offload=c.train_offload, roof=roof, p=costs.ColocatedParams(**table.get("colocated", {})))
    roof = dataclasses.replace(roof, kv_memory_fraction=share)
    nbytes = served.weight_bytes

    comm_params = costs.tp_comm_params(table, c.allreduce_inter_s)

    def mode(tp: int, first: int) -> RolloutMode:
        comm = (costs.tp_allreduce_s(model, gpu, tp, c.gpus_per_machine, comm_params)
                if c.tp_comm else (0.0, 0.0))
        if c.decode == "roofline":
            decode = costs.roofline_decode(served, gpu, tp, roof, comm)
        elif c.decode in table.get("decode", {}):
            # A fitted engine's coefficients; its prefill from the roofline.
            decode = dataclasses.replace(costs.roofline_decode(served, gpu, tp, roof),
                                         cost=costs.named_decode(c.decode, table))
        else:
            decode = costs.load_profiled(c.decode)
        kv = c.kv_capacity_tokens or costs.kv_capacity_tokens(served, gpu, tp, roof)
        w = cfg.workload
        if kv < w.prompt_len + w.len_max + 1:
            raise ValueError(f"invalid config cluster.kv_capacity_tokens={kv} at tp={tp}: one "
                             f"trajectory ({w.prompt_len} + {w.len_max} tokens) does not fit")
        if colocated:
            pull = costs.colocated_sync_s(nbytes, tp, sync) + switch
        elif c.weight_sync == "relay":
            pull = costs.relay_pull_s(nbytes, tp, gpu, sync)
        else:   # each rollout receives over the network
            pull = costs.nccl_sync_s(nbytes, tp, sync)
        return RolloutMode(tp=tp, rids=range(first, first + rollout_gpus // tp), decode=decode,
                           kv_capacity=int(kv), pull_s=c.pull_s if c.pull_s >= 0 else pull)

    modes, first = [], 0
    for tp in (c.rollout_tp, *(t for t in c.rollout_modes if t != c.rollout_tp)):
        modes.append(mode(tp, first))
        first = modes[-1].rids.stop
    if colocated:
        publish = 0.0
    elif c.weight_sync == "relay":
        publish = costs.publish_stall_s(nbytes, sync)
    else:   # the trainer waits for its broadcast
        publish = costs.nccl_sync_s(nbytes, c.rollout_tp, sync)
    # Every mode's instance r sits on the machine of its first GPU.
    machine = [((r - m.rids.start) * m.tp) // c.gpus_per_machine for m in modes for r in m.rids]
    arrive = [costs.chain_arrival_s(nbytes, mach, sync) if c.weight_sync == "relay" and not colocated
              else 0.0 for mach in machine]
    return Layout(train_gpus=train_gpus, rollouts=first, modes=tuple(modes),
                  relay_position=tuple(machine),
                  publish_s=c.publish_s if c.publish_s >= 0 else publish,
                  relay_arrival_s=tuple(arrive), colocated=colocated, model=model, gpu=gpu,
                  train=costs.TrainParams(**{**table.get("train", {}), "mfu": c.train_mfu}))


def steady_throughput(records: list[dict], warmup: int) -> float:
    """Trained prompt + response tokens per second after `warmup` steps: the tokens of
    records[warmup:] over the time from the end of step `warmup` (0: the start) to the
    last step's end."""
    if not records[warmup:]:
        return 0.0
    start = records[warmup - 1]["wall_s"] if warmup > 0 else 0.0
    return sum(r["seq_tokens"] for r in records[warmup:]) / max(records[-1]["wall_s"] - start, 1e-9)


def stream_schedule(done_s: Sequence[float], free_s: float, now: float, piece_s: float,
                    k: int) -> tuple[float, float]:
    """Stream generation's trainer (Laminar Fig. 3c; `ClusterSpec.stream_minibatches`):
    a batch's groups, in the order they finished (`done_s`), trained as k mini-batches of
    `piece_s` each. Mini-batch j starts once its groups are done and the trainer is free
    (`free_s`: the previous step's end, publish included); the last one not before `now`,
    when the controller hands the whole batch over. Returns (first start, last start).

    Gap (ours): the paper does not say how a step's batch splits; equal shares in
    finishing order ("early mini-batches on short trajectories"), each costing 1/k of
    the step, with nothing charged for the extra weight copy it keeps."""
    done = sorted(done_s)
    t, first = free_s, None
    for j in range(k - 1):
        start = max(t, done[math.ceil((j + 1) * len(done) / k) - 1])
        first = start if first is None else first
        t = start + piece_s
    last = max(t, now)
    return (last if first is None else first), last
