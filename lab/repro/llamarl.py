"""LlamaRL (seed 004, arXiv 2505.24034): its RL step against a colocated synchronous
baseline at 8B, 70B and 405B (Table 3: 2.52×, 3.98×, 10.7×).

Both sides are laid out by `fnrl.policy.split`, the paper's own planner (§7) over its
per-GPU memory model (Table 2), fed with the simulator's cost models:
  - baseline: `plan_colocated` picks one model-parallel degree m and the batch sizes
    under the shared limit (5W + A_t·b_t + K_g·b_g)/m ≤ M; the simulator runs `sync`,
    colocated, rollouts of TP m, at most b_g sequences each, with the KV room the
    trainer's state leaves (the memory model shrinks the baseline's batch);
  - LlamaRL: `plan_split` picks the trainer's GPUs and each side's degree under its own
    limit; the simulator runs LlamaRL's asynchronous off-policy mode (§4.2) as
    `partial_rollout` at η = 2, disaggregated, with the generator in fp8 where Table 3's
    headline row has it (70B, 405B). §4.2 has two parts: the trainer takes samples one
    step old, and long generations are broken off, cached and resumed in the following
    iteration ("inspired by partial rollouts", Kimi). A response resumed once under the
    next version, consumed a step later, holds tokens two versions old: η = 2 in fnrl's
    terms (the paper's "1 to n steps of delay" gives no n for its headline rows; this is
    the least that holds a resumed response). The same layouts without partial rollouts
    (`one_step`, η = 1) run beside them, so what the resume contributes shows apart.
Weight sync is LlamaRL's DDMA (§5.2): the `nccl` option (a GPU-to-GPU transfer the
trainer takes part in and waits for; `relay` stages through host memory, which DDMA
avoids), at Table 4's measured times.

Each size also runs Table 3's own headline layout (its GPU split, degrees and decode
concurrency) under the same cost models, so that what the planner chooses and what the
paper ran can be told apart.

The paper gives no cost for an all-reduce of a generator wider than a machine, but its
own 405B rows pay heavily for one (mp 32/32: 240.8 s a step, 16/16: 100.5 s, on the same
GPUs). `calibrate_inter_s` fits that one latency to those two rows, which are not
headline rows, and the runs labelled "calibrated" predict the headline with it
(`python -m lab.repro.llamarl` recomputes it).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from scipy.optimize import minimize_scalar

from fnrl.policy.split import Plan, SplitProblem, plan_colocated, plan_split
from fnrl.sim import costs
from fnrl.sim.cluster import Simulation
from fnrl.sim.config import ClusterSpec, SimConfig
from lab.repro import Claim, Setup, register, squared_log_error
from fnrl.sim.workload import WorkloadSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class Size:
    """One model size of Table 3: its GPUs, the two step times, the headline LlamaRL
    row's layout (trainer GPUs, degrees, precision, decode concurrency per instance) and
    the baseline's (one degree, its concurrency), and Table 4's DDMA time."""

    name: str
    model: str
    gpus: int
    baseline_s: float
    llamarl_s: float
    gen_dtype_bytes: int        # 2: bf16; 1: fp8
    ddma_s: float
    paper_train_gpus: int
    paper_mp_gen: int
    paper_seqs_gen: int
    paper_mp_colocated: int
    paper_seqs_colocated: int

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.llamarl_s


# Table 3 (step times, GPUs, mp, "max decode concurrency" = per dp group × dp size) and
# Table 4 (DDMA: 0.04 s at 7/8B, 1.15 s at 70B, 2.31 s at 405B). The 70B fp8 row's
# concurrency "16 x 34" reads as 34 = 136 / 4 generator instances (the digest notes the
# GPU columns look swapped); its 120-GPU generator at mp 4 makes 30, as used here.
SIZES = (
    Size(name="8B", model="llama3.1-8b", gpus=256, baseline_s=22.45, llamarl_s=8.90,
         gen_dtype_bytes=2, ddma_s=0.04, paper_train_gpus=128, paper_mp_gen=1,
         paper_seqs_gen=32, paper_mp_colocated=8, paper_seqs_colocated=16),
    Size(name="70B", model="llama3.1-70b", gpus=256, baseline_s=82.32, llamarl_s=20.67,
         gen_dtype_bytes=1, ddma_s=1.15, paper_train_gpus=136, paper_mp_gen=4,
         paper_seqs_gen=16, paper_mp_colocated=8, paper_seqs_colocated=16),
    Size(name="405B", model="llama3.1-405b", gpus=1024, baseline_s=635.8, llamarl_s=59.5,
         gen_dtype_bytes=1, ddma_s=2.31, paper_train_gpus=512, paper_mp_gen=8,
         paper_seqs_gen=32, paper_mp_colocated=64, paper_seqs_colocated=32),
)

# §8.2: 512 prompts × n = 4 per step. MATH prompts and responses: lengths assumed (the
# paper gives none): prompts of 256 tokens, responses lognormal around 400 tokens
# (σ = 0.6), at most 2,048.
WORKLOAD = WorkloadSpec(groups_per_step=512, group_size=4, prompt_len=256, len_median=400,
                        len_sigma=0.6, len_max=2048)
FNRL_SIZE = "70B"     # the size whose LlamaRL layout also runs the `fnrl` preset
STEPS, QUICK_STEPS = 8, 2
LLAMARL_PRESET, LLAMARL_ETA = "partial_rollout", 2
NO_RESUME = " without resume"   # the suffix of the one_step runs (η = 1, no partial rollouts)
CALIBRATED = " calibrated"     # the suffix of the runs at CALIBRATED_INTER_S


@dataclasses.dataclass(frozen=True)
class Row:
    """A non-headline LlamaRL row of Table 3 that the calibration fits: bf16 generators."""

    mp_gen: int
    seqs_gen: int
    step_s: float


# Table 3's 405B rows with 512 trainer and 512 generator GPUs in bf16: mp 32/32 at "32 x
# 16" (32 sequences an instance), 16/16 at "48 x 32". Only the generator's degree (and
# its concurrency) differs; the trainer's mp is not in the simulator's FLOPs model.
CALIBRATION_ROWS = (Row(mp_gen=32, seqs_gen=32, step_s=240.8),
                    Row(mp_gen=16, seqs_gen=48, step_s=100.5))
CALIBRATED_INTER_S = 358e-6
"""A cross-machine all-reduce's latency fitted to CALIBRATION_ROWS (`calibrate_inter_s`,
seed 0, 8 steps): 7× costs.toml's 50 µs, so it stands for whatever the paper's inference
library paid per cross-machine all-reduce, not for a network's latency."""


def mean_response(w: WorkloadSpec) -> float:
    """The lognormal's mean (its clipping at len_max moves it by < 0.1% here)."""
    return w.len_median * math.exp(w.len_sigma ** 2 / 2)


def expected_longest(w: WorkloadSpec, b: int) -> float:
    """The longest of b responses, roughly: the lognormal's b/(b + 1) quantile, clipped."""
    z = statistics.NormalDist().inv_cdf(b / (b + 1))
    return min(w.len_median * math.exp(w.len_sigma * z), w.len_max)


def activation_bytes(model: costs.ModelSpec, seq: int) -> float:
    """A_t per sample: with activation checkpointing the trainer keeps each layer's input,
    hidden × 2 bytes per token per layer (assumed; the paper gives no A_t)."""
    return model.layers * model.attn_dim * model.dtype_bytes * seq


def problem(size: Size, w: WorkloadSpec = WORKLOAD, table: dict | None = None) -> SplitProblem:
    """Table 2's memory model for one size: M is vLLM's share of HBM, a sequence holds the
    KV of its longest context."""
    table = table or costs.load_table()
    gpu, model = costs.gpu_spec("h100", table), costs.model_spec(size.model, table)
    roof = costs.RooflineParams(**table.get("roofline", {}))
    seq = w.prompt_len + w.len_max
    return SplitProblem(gpus=size.gpus, batch=w.groups_per_step * w.group_size,
                        gpu_memory=gpu.hbm_bytes * roof.kv_memory_fraction,
                        weights=model.weight_bytes,
                        gen_weights=model.params * size.gen_dtype_bytes,
                        act_per_sample=activation_bytes(model, seq),
                        kv_per_sample=model.kv_bytes_per_token * seq)


def per_sample_times(size: Size, generator_dtype_bytes: int, w: WorkloadSpec = WORKLOAD,
                     table: dict | None = None, inter_s: float = 0.0):
    """(η_t(b, m), η_g(b, m)) from the simulator's own cost models: the trainer's FLOPs
    for a sample of mean length on m GPUs (no batch effect in that model), and one
    instance of m GPUs prefilling and decoding a batch of b (roofline, with TP
    communication)."""
    table = table or costs.load_table()
    gpu, model = costs.gpu_spec("h100", table), costs.model_spec(size.model, table)
    roof = costs.RooflineParams(**table.get("roofline", {}))
    comm = costs.tp_comm_params(table, inter_s)
    train = costs.TrainParams(**table.get("train", {}))
    served = dataclasses.replace(model, dtype_bytes=generator_dtype_bytes)
    machine = ClusterSpec().gpus_per_machine
    response = mean_response(w)
    flops = costs.train_flops(model, [w.prompt_len + response],
                              logprob_forward=train.logprob_forward)

    def eta_t(b: int, m: int) -> float:
        return flops / (m * gpu.peak_flops * train.mfu)

    def eta_g(b: int, m: int) -> float:
        # τ_g(b) is the time to generate a batch of b (Definition 7.3), so it ends with the
        # batch's longest response: all b decode together for the mean length, then the
        # longest goes on alone to the expected maximum of b draws.
        engine = costs.roofline_decode(served, gpu, m, roof,
                                       costs.tp_allreduce_s(model, gpu, m, machine, comm))
        mean, longest = round(response), round(expected_longest(w, b))
        wave = (b * w.prompt_len * engine.prefill_s_per_token
                + costs.decode_steps_s(engine.cost, b * w.prompt_len, b, mean)
                + costs.decode_steps_s(engine.cost, w.prompt_len + mean, 1,
                                       max(longest - mean, 0)))
        return wave / b

    return eta_t, eta_g


def kv_room_tokens(p: SplitProblem, kv_per_token: float, m: int, held: float) -> int:
    """KV tokens an instance of m GPUs holds once `held` bytes (weights, and in the
    colocated baseline the trainer's state) are in."""
    return int((m * p.gpu_memory - held) // kv_per_token)


def plans(size: Size, w: WorkloadSpec = WORKLOAD, inter_s: float = 0.0) -> tuple[Plan, Plan]:
    """(colocated, split): the baseline in bf16 throughout, LlamaRL's generator in the
    headline row's precision; `inter_s` > 0: the planner sees that cross-machine
    all-reduce latency, as the simulated engines do."""
    p = problem(size, w)
    colocated = plan_colocated(dataclasses.replace(p, gen_weights=0.0),
                               *per_sample_times(size, 2, w, inter_s=inter_s))
    return colocated, plan_split(
        p, *per_sample_times(size, size.gen_dtype_bytes, w, inter_s=inter_s))


def _cluster(size: Size, **kw) -> ClusterSpec:
    return ClusterSpec(gpu="h100", model=size.model, decode="roofline", tp_comm=True, **kw)


def at_inter_s(cfg: SimConfig, inter_s: float) -> SimConfig:
    """`cfg` with its engines paying `inter_s` per cross-machine all-reduce (0: the table's)."""
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster,
                                                                allreduce_inter_s=inter_s))


def baseline_config(size: Size, mp: int, seqs: int, b_t: int | None, steps: int,
                    w: WorkloadSpec = WORKLOAD) -> SimConfig:
    """`sync` colocated: every GPU trains, then serves at TP mp, its KV room what the
    trainer's state (4W + A_t·b_t) and the weights leave; b_t None: Table 3's layout,
    which Table 2's model cannot hold at 70B (5W/8 = 88 GB a GPU), so its KV room is
    the engine's own and its stated concurrency the limit."""
    p, model = problem(size, w), costs.model_spec(size.model)
    kv = 0 if b_t is None else kv_room_tokens(p, model.kv_bytes_per_token, mp,
                                               5 * p.weights + p.act_per_sample * b_t)
    return SimConfig(preset="sync", gpus=size.gpus, steps=steps, plots=False, workload=w,
                     cluster=_cluster(size, placement="colocated", rollout_tp=mp,
                                      max_num_seqs=seqs, kv_capacity_tokens=kv))


def llamarl_config(size: Size, train_gpus: int, mp_gen: int, seqs: int, steps: int,
                   preset: str = LLAMARL_PRESET, w: WorkloadSpec = WORKLOAD) -> SimConfig:
    """Disaggregated: the trainer on its GPUs, generators of TP mp_gen (fp8 where the
    headline row is), weights moved by DDMA in Table 4's time. LlamaRL's own mode is
    `partial_rollout` at η = 2 (the module's docstring says why); other presets keep
    their own η."""
    p, model = problem(size, w), costs.model_spec(size.model)
    eta = LLAMARL_ETA if preset == LLAMARL_PRESET else -1
    return SimConfig(preset=preset, eta=eta, gpus=size.gpus, steps=steps, plots=False,
                     workload=w,
                     cluster=_cluster(size, placement="disaggregated", train_gpus=train_gpus,
                                      rollout_tp=mp_gen, max_num_seqs=seqs,
                                      rollout_dtype_bytes=size.gen_dtype_bytes,
                                      weight_sync="nccl", publish_s=size.ddma_s,
                                      pull_s=size.ddma_s,
                                      kv_capacity_tokens=kv_room_tokens(
                                          p, model.kv_bytes_per_token, mp_gen, p.gen_weights)))


def runs_for(size: Size, steps: int, inter_s: float = 0.0) -> dict[str, SimConfig]:
    """Both layouts of one size: the baseline and LlamaRL, and at the assumed costs
    (`inter_s` 0) LlamaRL without resume too; `inter_s` > 0: the runs labelled
    calibrated, planned and simulated at that cross-machine all-reduce latency."""
    colocated, split = plans(size, inter_s=inter_s)
    suffix = CALIBRATED if inter_s > 0 else ""
    runs = {
        f"baseline {size.name}{suffix}": baseline_config(
            size, colocated.mp_gen, colocated.batch_gen, colocated.batch_train, steps),
        f"baseline {size.name} (Table 3){suffix}": baseline_config(
            size, size.paper_mp_colocated, size.paper_seqs_colocated, None, steps),
    }
    layouts = {"": (split.gpus_train, split.mp_gen, split.batch_gen),
               " (Table 3)": (size.paper_train_gpus, size.paper_mp_gen, size.paper_seqs_gen)}
    for tag, layout in layouts.items():
        runs[f"llamarl {size.name}{tag}{suffix}"] = llamarl_config(size, *layout, steps)
        if not inter_s:
            runs[f"llamarl {size.name}{tag}{NO_RESUME}"] = llamarl_config(
                size, *layout, steps, preset="one_step")
    return {name: at_inter_s(cfg, inter_s) for name, cfg in runs.items()}


def calibration_error(inter_s: float, seed: int = 0, steps: int = STEPS) -> float:
    """Sum over CALIBRATION_ROWS of the squared log error of the simulated step time
    (LlamaRL's mode, 405B, 512 + 512 GPUs, bf16 generators) at this latency."""
    size = dataclasses.replace(next(s for s in SIZES if s.name == "405B"), gen_dtype_bytes=2)

    def step_s(row: Row) -> float:
        cfg = at_inter_s(llamarl_config(size, 512, row.mp_gen, row.seqs_gen, steps), inter_s)
        return Simulation(dataclasses.replace(cfg, seed=seed)).run()["step_s"]
    return squared_log_error((step_s(row), row.step_s) for row in CALIBRATION_ROWS)


def calibrate_inter_s(lo: float = 10e-6, hi: float = 5e-3, seed: int = 0,
                      log=print) -> float:
    """The cross-machine all-reduce latency that best fits CALIBRATION_ROWS: a bounded
    scalar search (Brent's) on its logarithm, where the error has one minimum (each
    row's step time grows with the latency), rounded to the µs."""
    def error(x: float) -> float:
        err = calibration_error(math.exp(x), seed)
        log(f"  {math.exp(x) * 1e6:.0f} µs: error {err:.4f}")
        return err
    res = minimize_scalar(error, bounds=(math.log(lo), math.log(hi)), method="bounded",
                          options={"xatol": 0.005})
    return round(math.exp(res.x), 6)


@register("llamarl")
def setup(quick: bool = False) -> Setup:
    steps = QUICK_STEPS if quick else STEPS
    runs: dict[str, SimConfig] = {}
    claims = []
    for size in SIZES:
        runs.update(runs_for(size, steps))
        runs.update(runs_for(size, steps, CALIBRATED_INTER_S))
        for tag in ("", " (Table 3)"):
            for resume in ("", NO_RESUME, CALIBRATED):
                base = f"baseline {size.name}{tag}{CALIBRATED if resume == CALIBRATED else ''}"
                claims.append(Claim(name=f"{size.name}{tag or ' (planned)'}{resume}",
                                    system=f"llamarl {size.name}{tag}{resume}",
                                    baseline=base, paper=size.speedup,
                                    metric="step_s", lower_is_better=True))
    fnrl_size = next(s for s in SIZES if s.name == FNRL_SIZE)
    _, split = plans(fnrl_size)
    runs["fnrl"] = llamarl_config(fnrl_size, split.gpus_train, split.mp_gen, split.batch_gen,
                                  steps, preset="fnrl")
    return Setup(
        paper="LlamaRL (seed 004)",
        setup=("Llama 3.1 8B / 70B / 405B on 256 / 256 / 1,024 H100s, MATH, 512 prompts × 4 "
               "per step (global batch 2,048). Baseline: synchronous on-policy, generation "
               "and training colocated at one mp (DeepSpeed-Chat-like). LlamaRL: trainer and "
               "generator on their own GPUs, one step off-policy with partial rollouts "
               "(long generations resumed in the next iteration), DDMA weight sync, fp8 "
               "generator at 70B and 405B. Metric: seconds per RL step (Table 3)."),
        runs=runs, claims=tuple(claims),
        assumptions=(
            "Layouts from fnrl.policy.split (planned) and, beside them, Table 3's own.",
            "Memory per GPU M = 0.9 × 80 GB; trainer 4W + A_t·b_t (Table 2), A_t = "
            "layers × hidden × 2 bytes × (prompt + max response) (activation "
            "checkpointing); K_g = KV bytes per token × (prompt + max response).",
            "MATH lengths: prompts 256 tokens, responses lognormal median 400, σ 0.6, "
            "max 2,048 (the paper gives none).",
            "Decode: the roofline model with two TP all-reduces a layer, 10 µs within a "
            "machine and 50 µs across machines (costs.toml [tp_comm]).",
            "Training: FLOPs at MFU 0.35 on the trainer's GPUs, whatever its mp.",
            "DDMA as the nccl option at Table 4's times (0.04 / 1.15 / 2.31 s).",
            "LlamaRL's mode (§4.2): partial_rollout at η = 2, one step of delay plus a "
            "response resumed once in the next iteration (the paper gives no n for its "
            "'1 to n steps of delay'); the rows 'without resume' run one_step (η = 1).",
            f"The rows 'calibrated' plan and simulate with a cross-machine all-reduce of "
            f"{CALIBRATED_INTER_S * 1e6:.0f} µs, fitted to Table 3's 405B mp 32/32 and 16/16 "
            "rows (240.8 s, 100.5 s), not to a headline row.",
            f"The fnrl preset runs on the {FNRL_SIZE} planned LlamaRL layout.",
        ))


if __name__ == "__main__":     # python -m lab.repro.llamarl: recompute the calibration
    fitted = calibrate_inter_s()
    print(f"cross-machine all-reduce latency fitted to Table 3's 405B rows: "
          f"{fitted * 1e6:.0f} µs (CALIBRATED_INTER_S: {CALIBRATED_INTER_S * 1e6:.0f} µs)")
