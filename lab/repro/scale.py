"""The simulator's own scale setup (lab/benchmarks/sim_scale.py): no paper states it, so it
has no claim; its "sync" and "fnrl" runs serve lab.repro.ablate.

Setup (assumed where the seeds leave it open): Qwen3-30B-A3B on H100 (roofline decode),
1,024 GPUs, of which 256 train and 768 serve 192 rollouts at TP 4 (one relay per
machine), 128 groups of 16 per step, prompts of 1,024 tokens, lognormal responses
(median 4K, σ = 1, clipped at 20,480), decision cycles at least 5 virtual seconds apart
(Laminar's repack period; StaleFlow leaves its snapshot period open), η = 3 for fnrl.
"""

from __future__ import annotations

from fnrl.sim.config import ClusterSpec, SimConfig
from lab.repro import Setup, register
from fnrl.sim.workload import WorkloadSpec

STEPS = 50
"""Enough steps that the pipeline's fill (the first batch's tail) is a small share; the
benchmark's 100 take twice the CPU for each of the ablation's runs."""


def config(preset: str, steps: int, gpus: int, eta: int, cycle_s: float, ablate=(),
           placement: str = "disaggregated", weight_sync: str = "relay",
           workload: WorkloadSpec | None = None) -> SimConfig:
    """The scale setup for `preset` (η < 0: the preset's own)."""
    return SimConfig(preset=preset, gpus=gpus, steps=steps, eta=eta, cycle_s=cycle_s, plots=False,
                     ablate=tuple(ablate),
                     cluster=ClusterSpec(model="qwen3-30b-a3b", gpu="h100", train_gpus=gpus // 4,
                                         rollout_tp=4, placement=placement,
                                         weight_sync=weight_sync),
                     workload=workload or WorkloadSpec(
                         groups_per_step=128, group_size=16, prompt_len=1024, len_median=4096,
                         len_sigma=1.0, len_max=20480))


@register("scale")
def scale(quick: bool) -> Setup:
    if quick:   # 12 rollouts, 3 steps of 8 groups of 4 short responses: seconds
        gpus, steps = 64, 3
        workload = WorkloadSpec(groups_per_step=8, group_size=4, prompt_len=256,
                                len_median=512, len_sigma=1.0, len_max=2048)
    else:
        gpus, steps, workload = 1024, STEPS, None
    return Setup(
        paper="The simulator's scale setup (no paper)",
        setup=f"{gpus} H100s (a quarter training, the rest rollouts at TP 4), Qwen3-30B-A3B, "
              f"{steps} steps, lognormal responses, relay weight sync; sync against fnrl at η = 3.",
        runs={"sync": config("sync", steps, gpus, -1, 5.0, workload=workload),
              "fnrl": config("fnrl", steps, gpus, 3, 5.0, workload=workload)},
        assumptions=("Everything: no paper states this setup (lab/repro/scale.py).",
                     "η = 3 for fnrl (the preset's own is 2), as in docs/simulation.md's scale "
                     "benchmark."))
