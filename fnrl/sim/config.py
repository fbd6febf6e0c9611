"""The simulator's configuration: the cluster, the workload and the run."""

from __future__ import annotations

from dataclasses import dataclass, field

from fnrl.config.base import check
from fnrl.sim.workload import WorkloadSpec

PLACEMENTS = ("disaggregated", "colocated")
WEIGHT_SYNCS = ("relay", "nccl")
ABLATIONS = ("repack", "balance", "migration", "lazy_sync", "routing", "sampler", "eta")
ENABLES = ("repack", "balance", "migration", "lazy_sync", "global_sync", "dispatch")
"""What `SimConfig.ablate` switches off (fnrl.sim.coordinator.plan_for): Laminar's repack,
OrchestrRL's balancer, StaleFlow's migration (Alg. 5), StaleFlow's lazy sync (Alg. 4,
replaced by its §6.5 "vanilla" sync: pull whenever behind), StaleFlow's waterfall routing
(Alg. 3, replaced by its §6.5 "vanilla" routing: the fewest trajectories), the sampler
(the head buffer trained as the protocol filled it) and the looser staleness bound (η
down to one_step's). `SimConfig.enable` takes the first four, and for the verl-built
baselines "global_sync", verl's global weight sync (`RoutingConfig.sync="global"`), and
"dispatch", verl's dispatch: every trajectory in the trajectory server routed at once,
spread by count (the fewest-trajectories routing with no cap a cycle), each engine
queueing and preempting what does not fit, in place of StaleFlow's admission."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    gpu: str = "h100"
    """A [gpu.NAME] of fnrl/sim/costs.toml."""
    model: str = "qwen3-30b-a3b"
    """A [model.NAME] of fnrl/sim/costs.toml."""
    placement: str = "disaggregated"
    """"disaggregated" (trainer and rollouts on their own GPUs) or "colocated" (verl-style:
    both on every GPU, taking turns; only with η = 0)."""
    train_gpus: int = 0
    """Trainer GPUs when disaggregated (0: half of them)."""
    rollout_tp: int = 4
    """GPUs per rollout instance (with rollout_modes: the mode the run starts in)."""
    rollout_modes: tuple[int, ...] = ()
    """TP degrees the rollout GPUs switch between within a run (OrchestrRL §4.1, §6.3:
    8×TP2 → 2×TP8 as a step's wave drains). The simulator carries every mode's instances
    over the same GPUs, the current mode's up and the others reporting no KV room, as
    the real loop reports a rollout that is down; every `replan_s` OrchestrRL's planner
    (fnrl.policy.orchestr.replan) may switch, at `switch_s`. Simulator only: a vLLM
    server cannot change its TP while it runs, and the real job's config rejects it.
    (): the deployment is fixed for the run."""
    replan_s: float = 30.0
    """With rollout_modes: seconds between two re-plans (the paper's period is not given)."""
    switch_s: float = 14.0
    """With rollout_modes: a switch's cost, no mode generating meanwhile (§6.3: ~14 s)."""
    gpus_per_machine: int = 8
    """One relay per rollout machine (Laminar)."""
    decode: str = "roofline"
    """"roofline" (from model and GPU), a [decode.NAME] of costs.toml, or the path of a
    JSON written by `python -m fnrl.experiments.profile_cost`."""
    weight_sync: str = "relay"
    """"relay" (Laminar: stall, chain broadcast, PCIe pull) or "nccl" (global broadcast)."""
    kv_capacity_tokens: int = 0
    """KV tokens per instance (0: HBM less weights, costs.kv_capacity_tokens)."""
    max_num_seqs: int = 1024
    memory_fraction: float = 0.0
    """vLLM's `gpu_memory_utilization` on the rollout GPUs: their weights and KV (0:
    costs.toml's roofline `kv_memory_fraction`; colocated, what the trainer's resident
    state leaves of it; verl's default is 0.5). Colocated runs check that both fit."""
    train_offload: bool = False
    """Colocated: the trainer's optimizer state goes to host while the engine generates
    (FSDP optimizer offload), paid over PCIe both ways every step."""
    train_mfu: float = 0.35
    train_step_s: float = 0.0
    """> 0: every train step takes this long (a measured figure) instead of the FLOPs model."""
    train_bucket_s: tuple[tuple[int, float, float], ...] = ()
    """(length bucket, steady s, first s), shortest bucket first: measured train calls
    (publish included) by the padded length a step compiles for, instead of train_step_s
    or the FLOPs model. A step takes the smallest bucket holding its longest sequence
    (prompt + response − 1 next-token positions, fnrl.trainer.batching.choose_length;
    the longest bucket if none does), and `first` the first time the run trains that
    bucket (the trainer loads its compiled step), else `steady`. With shared_cores, a
    first step's extra over `steady` is one thread's work."""
    stream_minibatches: int = 1
    """> 1: stream generation (Laminar Fig. 3c): the trainer trains each step's batch as
    this many mini-batches, of its groups in the order they finished, each as soon as its
    groups are done and the previous one is trained, and publishes after the last (the
    last starts once the whole batch is handed over). 1: the whole batch, once complete."""
    publish_s: float = -1.0
    """>= 0: the trainer's publish stall (measured) instead of the model's."""
    pull_s: float = -1.0
    """>= 0: a rollout's weight load (measured) instead of the model's."""
    rollout_dtype_bytes: int = 0
    """Bytes per weight on the rollouts (0: the model's; 1: fp8, as LlamaRL's generator,
    §4.3): their decode reads, KV room and weight loads."""
    tp_comm: bool = False
    """Charge every roofline decode step its tensor-parallel all-reduces (two a layer,
    fnrl.sim.costs.tp_allreduce_s, costs.toml [tp_comm]): over NVLink within one
    machine, dearer across machines (LlamaRL §4.3: mp > 8); off, TP scales perfectly."""
    allreduce_inter_s: float = 0.0
    """> 0: the latency of one tensor-parallel all-reduce across machines, instead of
    costs.toml's [tp_comm] `allreduce_inter_s` (what a given engine pays; with tp_comm)."""
    shared_cores: int = 0
    """> 0: every role runs on one host of this many CPU cores (a CPU-only replay of
    this machine: 2), shared thread by thread: a rollout with a running batch runs one
    thread, the trainer in a step `trainer_threads`, and when there are more threads
    than cores each gets cores / threads of one (a decode step is costed on a core of
    its own, train_step_s as the step runs alone). 0: each role has its own devices."""
    corun: str = ""
    """With shared_cores: a co-run table (lab/benchmarks/corun.py's JSON, fnrl.sim.costs.
    load_corun) in place of the thread-by-thread share: the train step's steady work is
    slowed by the factor measured beside that many generating rollouts, and a rollout's
    decode by the one measured with that many generating, the trainer stepping or not
    (over one rollout alone). A first step's extra stays one thread's share."""
    host_load: float = 0.0
    """With shared_cores (thread by thread, no co-run table): the cores that processes
    the simulator does not run take while any rollout generates, counted as that many
    more threads (this machine's loop streams every token, and its evaluation server
    shares the host: lab/benchmarks/role_cpu.py measures both)."""
    trainer_threads: int = 1
    """With shared_cores: the threads the trainer's step runs on (fnrl's trainer takes
    every allowed CPU by default, `trainer.cpu_threads = 0`: 2 on this machine); the
    step alone uses min(trainer_threads, shared_cores) cores. 1: each busy role counts
    as one thread."""

    def __post_init__(self):
        check(self.placement in PLACEMENTS, "ClusterSpec", "placement", self.placement,
              f"must be one of {PLACEMENTS}")
        check(self.weight_sync in WEIGHT_SYNCS, "ClusterSpec", "weight_sync", self.weight_sync,
              f"must be one of {WEIGHT_SYNCS}")
        for name in ("rollout_tp", "gpus_per_machine", "max_num_seqs",
                     "stream_minibatches", "trainer_threads"):
            check(getattr(self, name) > 0, "ClusterSpec", name, getattr(self, name), "must be > 0")
        for name in ("train_gpus", "kv_capacity_tokens", "train_step_s", "rollout_dtype_bytes",
                     "shared_cores", "allreduce_inter_s", "host_load"):
            check(getattr(self, name) >= 0, "ClusterSpec", name, getattr(self, name), "must be >= 0")
        buckets = self.train_bucket_s
        check(all(len(b) == 3 and b[0] > 0 and 0 < b[1] <= b[2] for b in buckets)
              and [b[0] for b in buckets] == sorted({b[0] for b in buckets}), "ClusterSpec",
              "train_bucket_s", buckets, "must be (length > 0, steady > 0, first >= steady) "
              "triples, lengths increasing")
        check(not self.corun or self.shared_cores > 0, "ClusterSpec", "corun", self.corun,
              "needs shared_cores > 0 (a co-run table describes one shared host)")
        check(not self.host_load or (self.shared_cores > 0 and not self.corun), "ClusterSpec",
              "host_load", self.host_load, "needs shared_cores > 0 and no co-run table (the "
              "table's factors were measured with their own load)")
        check(0 < self.train_mfu <= 1, "ClusterSpec", "train_mfu", self.train_mfu,
              "must be in (0, 1]")
        check(0 <= self.memory_fraction <= 1, "ClusterSpec", "memory_fraction",
              self.memory_fraction, "must be in [0, 1] (0: the default)")
        if self.rollout_modes:
            check(self.rollout_tp in self.rollout_modes and all(
                type(t) is int and 0 < t <= self.gpus_per_machine for t in self.rollout_modes),
                "ClusterSpec", "rollout_modes", self.rollout_modes,
                f"must be TP degrees in (0, gpus_per_machine={self.gpus_per_machine}] that "
                f"include rollout_tp={self.rollout_tp} (the mode the run starts in)")
            check(self.placement == "disaggregated" and self.shared_cores == 0, "ClusterSpec",
                  "rollout_modes", self.rollout_modes,
                  "needs placement='disaggregated' and shared_cores=0")
            check(self.replan_s > 0, "ClusterSpec", "replan_s", self.replan_s, "must be > 0")
            check(self.switch_s >= 0, "ClusterSpec", "switch_s", self.switch_s, "must be >= 0")
        check(not self.train_offload or self.placement == "colocated", "ClusterSpec",
              "train_offload", self.train_offload, "needs placement='colocated'")
        if self.stream_minibatches > 1:
            check(self.placement == "disaggregated" and self.shared_cores == 0, "ClusterSpec",
                  "stream_minibatches", self.stream_minibatches,
                  "needs placement='disaggregated' and shared_cores=0 (the trainer trains "
                  "early mini-batches while the rollouts generate)")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """python -m fnrl.sim --preset fnrl --gpus 1024 --steps 100 ..."""

    preset: str = "fnrl"
    """A preset of fnrl.config.presets: the same coordinator the real job runs."""
    gpus: int = 64
    steps: int = 20
    warmup_steps: int = 0
    """Steps before `steady_seq_tokens_per_s` starts counting (the seeds' metric: Laminar
    §8 averages 5 iterations after a 10-iteration warm-up)."""
    seed: int = 0
    eta: int = -1
    """>= 0: override the preset's staleness bound η."""
    ablate: tuple[str, ...] = ()
    """Mechanisms of the preset switched off: any of ABLATIONS."""
    enable: tuple[str, ...] = ()
    """Mechanisms switched on over the preset (any of ENABLES), e.g. OrchestrRL's
    coordinator is `one_step` with "balance"."""
    coord_cost: str = "engine"
    """The decode cost model the coordinator plans with (its `coord.cost`: routing's and
    lazy sync's estimates), apart from the cost the engines pay (`cluster.decode`):
    "engine" (the engines' own, as a real job given their profile with
    `--coord.cost-file`), "default" (fnrl.config.CostModel's defaults, StaleFlow's
    Table 4, as a real job given no cost file), a [decode.NAME] of costs.toml, or the
    path of a JSON written by `python -m fnrl.experiments.profile_cost`."""
    cycle_s: float = 1.0
    """Least virtual time between two decision cycles; a cycle runs when something landed
    (a trajectory finished, a pull, a step) or commands were issued. The loop's own tick
    is 0.1 s (with --loop-ticks, the exact cadence); a coarser one keeps long runs fast
    (a 20K-token response takes minutes, a cycle at 1,024 GPUs ~10 ms of CPU)."""
    loop_ticks: bool = False
    """Tick exactly as the real loop does: a cycle at every wake, and one `cycle_s` after
    every cycle even when nothing happened (its idle tick). Exact, but slow at scale."""
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    out: str = ""
    """Run directory ('': runs/sim-PRESET-GPUS)."""
    timeline_rollouts: int = 8
    """Rollouts whose placements the timeline records."""
    timeline_dt_s: float = 1.0
    plots: bool = True

    def __post_init__(self):
        for name in ("gpus", "steps"):
            check(getattr(self, name) > 0, "SimConfig", name, getattr(self, name), "must be > 0")
        check(0 <= self.warmup_steps < self.steps, "SimConfig", "warmup_steps", self.warmup_steps,
              f"must be in [0, steps={self.steps})")
        check(self.cycle_s >= 0, "SimConfig", "cycle_s", self.cycle_s, "must be >= 0")
        for name in self.ablate:
            check(name in ABLATIONS, "SimConfig", "ablate", self.ablate, f"must be among {ABLATIONS}")
        for name in self.enable:
            check(name in ENABLES and name not in self.ablate, "SimConfig", "enable",
                  self.enable, f"must be among {ENABLES} and not ablated")
        check(bool(self.coord_cost), "SimConfig", "coord_cost", self.coord_cost,
              "must be 'engine', 'default', a [decode.NAME] of costs.toml or a cost file")
        check(self.timeline_dt_s > 0, "SimConfig", "timeline_dt_s", self.timeline_dt_s, "must be > 0")
