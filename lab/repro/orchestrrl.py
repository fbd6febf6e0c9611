"""OrchestrRL (seed 003, §6.1 Fig. 9): end-to-end throughput of one-step asynchronous
GRPO over veRL-TO, on 32 and 48 H800 GPUs, at 15K and 25K generation lengths.

    python -m lab.repro orchestrrl --seeds 0 1 2

Systems (§6 "Baselines"; all one-step asynchronous, training and generation on equal
halves of the GPUs, §6.1):
  verl_to     throughput-oriented: the most instances, TP = 2 (§6.3: 8×TP2 for 14B);
  verl_lo     latency-oriented: the largest TP in a node, TP = 8 (§6.3: 2×TP8);
  pr          partial rollout over veRL-TO: responses carried over to the next version
              (the `partial_rollout` preset, η = 2);
  orchestrrl  the `one_step` coordinator with OrchestrRL's reactive balancer
              (fnrl.policy.balance), starting on the deployment its proactive planner
              (fnrl.policy.orchestr) picks for the forecast step, and re-planning every
              30 s over every TP degree whose instance holds a whole trajectory
              (ClusterSpec.rollout_modes): a switch costs 14 s (§6.3) and sends the
              old mode's trajectories back to be re-routed;
  fnrl        the `fnrl` preset on veRL-TO's deployment.
The headline setup (Qwen-14B, 25K: "up to 1.40×") has the bare labels; the other three
carry "@14b-15k", "@32b-15k", "@32b-25k".

The planner's first plan uses a forecast from past steps of the same workload; each
re-plan adds the run's own trained steps (fnrl.sim.reconfig).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fnrl.policy import orchestr
from fnrl.sim import costs
from fnrl.sim.config import ClusterSpec, SimConfig
from fnrl.sim.reconfig import prior_history
from lab.repro import Claim, Setup, register
from fnrl.sim.workload import WorkloadSpec

# (label suffix, model, GPUs, generation length, paper's speedup over veRL-TO) — §6.1.
CASES = (("", "qwen2.5-14b", 32, 25 * 1024, 1.40),
         ("@14b-15k", "qwen2.5-14b", 32, 15 * 1024, 1.31),
         ("@32b-15k", "qwen2.5-32b", 48, 15 * 1024, 1.32),
         ("@32b-25k", "qwen2.5-32b", 48, 25 * 1024, 1.34))
# §6.2's ablation over the static baseline (veRL-TO): the proactive planner alone, 1.23×
# (14B) and 1.19× (32B); with reactive balancing it is the 25K headline (1.40×, 1.34×), so
# the ablation is read as the 25K cases.
PLANNER_ALONE = {"": 1.23, "@32b-25k": 1.19}
TP_TO, TP_LO = 2, 8                   # §6.3
REPLAN_S, SWITCH_S = 30.0, 14.0       # the re-plan period (not given) and a switch (§6.3)
CANDIDATE_TP = (1, 2, 4, 8)           # TP within one 8-GPU node (§4.1 heuristic 2)


def workload(len_max: int, groups: int) -> WorkloadSpec:
    # Assumed (Fig. 3 is lost; "most responses are of moderate length (less than
    # 7.5K)", §2): lognormal, median 3K, σ 0.8 puts 87% under 7.5K; batch 128 × 8.
    return WorkloadSpec(groups_per_step=groups, group_size=8, prompt_len=512,
                        len_median=3072, len_sigma=0.8, len_max=len_max)


def modes(model: str, len_max: int, table: dict | None = None) -> tuple[orchestr.Mode, ...]:
    """The planner's candidates: each TP degree's decode cost and KV capacity, from the
    same cost models the simulator runs (fnrl.sim.costs), all-reduces included."""
    table = table or costs.load_table()
    m, gpu = costs.model_spec(model, table), costs.gpu_spec("h800", table)
    roof = costs.RooflineParams(**table.get("roofline", {}))
    comm, machine = costs.tp_comm_params(table), ClusterSpec().gpus_per_machine
    out = []
    for tp in CANDIDATE_TP:
        try:
            kv = costs.kv_capacity_tokens(m, gpu, tp, roof)
        except ValueError:
            continue      # the weights do not fit
        out.append(orchestr.Mode(tp=tp, kv_capacity=kv,
                                 cost=costs.roofline_decode(
                                     m, gpu, tp, roof,
                                     costs.tp_allreduce_s(m, gpu, tp, machine, comm)).cost))
    return tuple(out)


def plan(model: str, gpus: int, spec: WorkloadSpec) -> orchestr.ParallelismPlan:
    """The planner on a fresh step: the forecast of past steps' length quantiles (drawn
    from the same workload with their own seed), as one length per request."""
    n = spec.groups_per_step * spec.group_size
    problem = orchestr.ParallelismProblem(gpus=gpus // 2, modes=modes(model, spec.len_max))
    return orchestr.replan(problem, prior_history(spec), np.zeros(n),
                           np.full(n, float(spec.prompt_len)), current_tp=None,
                           len_max=spec.len_max, requests_per_step=n)


@register("orchestrrl")
def setup(quick: bool) -> Setup:
    steps, groups = (2, 16) if quick else (8, 128)
    runs, claims, ablation, notes = {}, [], [], []
    for suffix, model, gpus, len_max, paper in CASES:
        spec = workload(len_max, groups)
        chosen = plan(model, gpus, spec)
        notes.append(f"{model}, {gpus} GPUs, {len_max} tokens: the planner picks "
                     f"{chosen.instances}×TP{chosen.tp}; its makespan estimates per TP: "
                     + ", ".join(f"TP{tp} {s:.0f} s" for tp, s in chosen.candidates))

        def sim(preset: str, tp: int, enable: tuple[str, ...] = (),
                rollout_modes: tuple[int, ...] = ()) -> SimConfig:
            return SimConfig(preset=preset, gpus=gpus, steps=steps, enable=enable, plots=False,
                             cluster=ClusterSpec(model=model, gpu="h800", train_gpus=gpus // 2,
                                                 rollout_tp=tp, tp_comm=True, rollout_modes=rollout_modes,
                                                 replan_s=REPLAN_S, switch_s=SWITCH_S),
                             workload=spec)

        # verl's one-step pipeline syncs weights at stage boundaries, all rollouts at once,
        # and hands each replica its share of the batch (every system but fnrl is verl's).
        runs[f"verl_to{suffix}"] = sim("one_step", TP_TO, ("global_sync", "dispatch"))
        runs[f"verl_lo{suffix}"] = sim("one_step", TP_LO, ("global_sync", "dispatch"))
        runs[f"pr{suffix}"] = sim("partial_rollout", TP_TO, ("dispatch",))
        fits = tuple(m.tp for m in modes(model, len_max)
                     if m.kv_capacity > spec.prompt_len + len_max)
        runs[f"orchestrrl{suffix}"] = sim("one_step", chosen.tp,
                                          ("balance", "global_sync", "dispatch"), fits)
        runs[f"fnrl{suffix}"] = sim("fnrl", TP_TO)
        name = f"{model.removeprefix('qwen2.5-').upper()}, {gpus} GPUs, {len_max // 1024}K"
        claims.append(Claim(name=f"OrchestrRL / veRL-TO ({name})", system=f"orchestrrl{suffix}",
                            baseline=f"verl_to{suffix}", paper=paper))
        if suffix in PLANNER_ALONE:   # §6.2: the planner and its switches, no balancer
            runs[f"planner{suffix}"] = sim("one_step", chosen.tp, ("global_sync", "dispatch"),
                                           fits)
            ablation.append(Claim(name=f"planner alone / veRL-TO ({name})",
                                  system=f"planner{suffix}", baseline=f"verl_to{suffix}",
                                  paper=PLANNER_ALONE[suffix]))
    return Setup(
        paper="OrchestrRL (seed 003)",
        setup=("§6.1 Fig. 9: one-step asynchronous GRPO on H800s, Megatron-LM training and "
               "vLLM generation on equal halves of the GPUs; Qwen2.5-14B (OpenR1-Math-220k) "
               "on 32 GPUs and Qwen2.5-32B (DeepMath-103K) on 48, at generation lengths of "
               "15K and 25K tokens. OrchestrRL over veRL-TO: 1.31× and 1.40× (14B), 1.32× "
               "and 1.34× (32B); it 'consistently outperforms' veRL-LO and partial rollout "
               "(no figures). Ablation §6.2: the planner alone 1.23× / 1.19×."),
        runs=runs, claims=tuple(claims + ablation),
        assumptions=(
            "Lengths: lognormal, median 3,072, σ 0.8, clipped at the generation length "
            "(15K = 15,360, 25K = 25,600); prompts 512 tokens; 128 prompts × 8 responses a "
            "step (the paper gives neither lengths nor batch).",
            "veRL-TO is TP 2 and veRL-LO TP 8 for both models (§6.3 states them for 14B).",
            "Decode: the roofline model plus tensor-parallel all-reduces (cluster.tp_comm: "
            "two a layer, 10 µs each plus bytes over 200 GB/s NVLink at 80%); without them "
            "TP scales perfectly and veRL-LO would beat veRL-TO, the reverse of §6.3.",
            "Training: the FLOPs model at 35% MFU (costs.toml); weights by the relay.",
            "veRL-TO, veRL-LO and OrchestrRL (one-step, built on verl) sync weights at stage "
            "boundaries: every rollout pulls at once, once all have run dry (global_sync).",
            "Every system built on verl (all but fnrl) routes as verl does: each vLLM replica "
            "gets its share of the waiting requests at once, by count, and queues what does "
            "not fit (dispatch), not by StaleFlow's admission.",
            "The planner's forecast: 4 past steps of the same workload (their own seed), "
            "ARIMA(0,1,1) with smoothing 0.5 on 128 quantiles; candidates TP 1, 2, 4, 8.",
            "OrchestrRL starts on the plan for a fresh step and re-plans every 30 s (the "
            "paper's period is not given) over the TP degrees whose instance holds a whole "
            "trajectory; a switch costs 14 s (§6.3), with no instance generating "
            "meanwhile, and sends the old mode's "
            "trajectories back to the trajectory server with their tokens, to be re-routed "
            "and re-prefilled.",
            "Balancer θ = 0.5 and at most 64 moves a cycle (BalanceConfig defaults); "
            "decision cycles at least 1 s apart (the paper's interval is not given).",
            "fnrl runs on veRL-TO's deployment (TP 2) with its own η = 2."),
        notes=tuple(notes))
