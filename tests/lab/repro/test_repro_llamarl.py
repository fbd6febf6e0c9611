"""LlamaRL's reproduction (lab/repro/llamarl.py): the memory figures worked by
hand, the cost terms it adds (TP communication, an fp8 generator), and a quick run of
one size for structure (not the paper's figure)."""

import dataclasses
import math

import pytest

from fnrl.policy.split import colocated_memory, generator_memory
from fnrl.sim import costs
from fnrl.sim.layout import layout
from fnrl.sim.config import ClusterSpec, SimConfig
from lab.repro import SETUPS, reproduce
from lab.repro import llamarl

SIZE = {s.name: s for s in llamarl.SIZES}
GB = 1e9


def test_the_405b_baseline_must_shrink_to_mp_64_and_a_smaller_batch():
    p = llamarl.problem(SIZE["405B"])
    # W = 405e9 × 2 bytes; A_t = 126 layers × 16,384 × 2 bytes × 2,304 tokens; K_g =
    # 516,096 bytes a token × 2,304; M = 0.9 × 80 GB.
    assert (p.weights, p.gen_weights, p.gpu_memory) == (810 * GB, 405 * GB, 72 * GB)
    assert p.act_per_sample == 9_512_681_472 and p.kv_per_sample == 1_189_085_184
    # Trainer and generator together: 5W/32 = 126.6 GB a GPU at mp 32, over M before any
    # batch; at mp 64, 63.3 GB, which leaves room for b_g = 256 but not 512:
    # (4,050 + 9.5 + 304.4) / 64 = 68.19 GB, (4,050 + 9.5 + 608.8) / 64 = 72.9 GB.
    assert colocated_memory(p, 1, 8, 32) > 126 * GB > p.gpu_memory
    assert colocated_memory(p, 1, 256, 64) == pytest.approx(68.186 * GB, rel=1e-4)
    assert colocated_memory(p, 1, 512, 64) > p.gpu_memory
    colocated, split = llamarl.plans(SIZE["405B"])
    assert (colocated.mp_gen, colocated.batch_gen, colocated.gpus_gen) == (64, 256, 1024)
    # Apart, the fp8 generator fits one machine: (405 + 128 × 1.19) / 8 = 69.7 GB.
    assert generator_memory(p, 128, 8) == pytest.approx(69.650 * GB, rel=1e-4)
    assert split.gpus_train + split.gpus_gen == 1024 and split.mp_gen < colocated.mp_gen


def test_the_simulated_baseline_gets_the_kv_room_the_trainer_leaves():
    # 405B at mp 64, b_t = 1: 64 × 72 GB − 5W − A_t = 548.5 GB, / 516,096 bytes a token.
    cfg = llamarl.baseline_config(SIZE["405B"], 64, 256, 1, steps=2)
    room = 64 * 72 * GB - 5 * 810 * GB - 9_512_681_472
    assert cfg.cluster.kv_capacity_tokens == int(room // 516_096) == 1_062_762
    assert (cfg.preset, cfg.cluster.placement, cfg.cluster.max_num_seqs) == ("sync", "colocated", 256)


def test_tp_communication_and_an_fp8_generator_in_the_cost_model():
    comm, h100 = costs.TpCommParams(), costs.gpu_spec("h100")
    l405 = costs.model_spec("llama3.1-405b")
    # Two all-reduces a layer: 252 × 10 µs within a machine, 252 × 50 µs across; each
    # sequence's hidden vector (16,384 × 2 B) ring-reduced over NVLink (450 GB/s) or the
    # NIC (50 GB/s), at 80%.
    assert costs.tp_allreduce_s(l405, h100, 1, 8, comm) == (0.0, 0.0)
    fixed, per_seq = costs.tp_allreduce_s(l405, h100, 8, 8, comm)
    assert fixed == pytest.approx(2.52e-3)
    assert per_seq == pytest.approx(252 * 2 * 7 / 8 * 16384 * 2 / (450e9 * 0.8))
    fixed, per_seq = costs.tp_allreduce_s(l405, h100, 64, 8, comm)
    assert fixed == pytest.approx(12.6e-3)
    assert per_seq == pytest.approx(252 * 2 * 63 / 64 * 16384 * 2 / (50e9 * 0.8))
    base = SimConfig(preset="one_step", gpus=64, steps=1,
                     cluster=ClusterSpec(model="llama3.1-70b", rollout_tp=8, weight_sync="nccl"))
    plain = layout(base)
    fp8 = layout(dataclasses.replace(base, cluster=dataclasses.replace(
        base.cluster, rollout_dtype_bytes=1, tp_comm=True)))
    # fp8 halves the weights read each step and the bytes loaded; 160 × 10 µs more a step.
    assert fp8.decode.cost.k2 == pytest.approx(plain.decode.cost.k2 / 2)
    assert fp8.decode.cost.k4 == pytest.approx(plain.decode.cost.k4 + 1.6e-3)
    assert fp8.pull_s - 1.0 == pytest.approx((plain.pull_s - 1.0) / 2)
    assert fp8.kv_capacity > plain.kv_capacity


def test_the_setup_names_its_systems_and_claims():
    setup = SETUPS["llamarl"](True)
    assert {c.paper for c in setup.claims} == {22.45 / 8.90, 82.32 / 20.67, 635.8 / 59.5}
    for c in setup.claims:
        assert c.metric == "step_s" and c.lower_is_better
        assert {c.system, c.baseline} <= set(setup.runs)
    for size in llamarl.SIZES:
        run = setup.runs[f"llamarl {size.name}"].cluster
        assert (run.placement, run.weight_sync, run.publish_s, run.pull_s) == (
            "disaggregated", "nccl", size.ddma_s, size.ddma_s)
        assert run.rollout_dtype_bytes == size.gen_dtype_bytes
        own, no_resume = (setup.runs[f"llamarl {size.name}{tag}"]
                          for tag in ("", llamarl.NO_RESUME))
        # §4.2: one step of delay plus a response resumed in the next iteration.
        assert (own.preset, own.eta) == ("partial_rollout", 2)
        assert (no_resume.preset, no_resume.eta) == ("one_step", -1)
        assert no_resume.cluster == own.cluster
        assert setup.runs[f"baseline {size.name}"].cluster.placement == "colocated"
    assert setup.runs["fnrl"].preset == "fnrl"
    assert setup.runs["fnrl"].cluster == setup.runs[f"llamarl {llamarl.FNRL_SIZE}"].cluster


def test_a_quick_run_of_the_8b_pair():
    own, no_resume = "llamarl 8B", "llamarl 8B" + llamarl.NO_RESUME
    res = reproduce("llamarl", seeds=(0,), quick=True, only=("baseline 8B", own, no_resume),
                    log=lambda _: None)
    base, split, plain = (res.summaries[0][k] for k in ("baseline 8B", own, no_resume))
    assert base["steps"] == split["steps"] == plain["steps"] == llamarl.QUICK_STEPS
    assert base["train_gpus"] == 256 and split["train_gpus"] + split["rollout_gpus"] == 256
    # LlamaRL's mode breaks long responses off at each new version and resumes them, each
    # within two versions of the trainer; without resume nothing is interrupted.
    assert split["interrupted"] > 0 and split["staleness_checked_max"] <= 2
    assert plain["interrupted"] == 0 and plain["staleness_checked_max"] == 1
    assert base["staleness_checked_max"] == 0
    assert 0 < split["step_s"] < base["step_s"] and 0 < plain["step_s"] < base["step_s"]


@pytest.mark.slow
def test_the_calibrated_cross_machine_latency_is_the_best_fit_to_the_two_405b_rows():
    c = llamarl.CALIBRATED_INTER_S
    err = {f: llamarl.calibration_error(c * f) for f in (0.8, 1.0, 1.25)}
    assert err[1.0] < err[0.8] and err[1.0] < err[1.25]
    # Each row within 15% of the paper's at the fitted value (both cannot be met exactly
    # by one latency: measured −13% and +11%), and both far off at costs.toml's 50 µs.
    assert err[1.0] < 2 * math.log(1.15) ** 2
    assert llamarl.calibration_error(50e-6) > 0.5


def test_the_calibrated_runs_use_the_fitted_latency_and_only_they():
    setup = SETUPS["llamarl"](True)
    for name, cfg in setup.runs.items():
        calibrated = name.endswith(llamarl.CALIBRATED)
        assert cfg.cluster.allreduce_inter_s == (llamarl.CALIBRATED_INTER_S if calibrated else 0.0)
    claims = {c.name: c for c in setup.claims}
    assert claims["405B (Table 3) calibrated"].baseline == "baseline 405B (Table 3) calibrated"
    # A cross-machine latency changes nothing within one machine: 8B's Table 3 layouts.
    plain, cal = (setup.runs[f"llamarl 8B (Table 3){s}"] for s in ("", llamarl.CALIBRATED))
    assert layout(plain).decode.cost == layout(cal).decode.cost
    wide = setup.runs["baseline 405B (Table 3)"]          # TP 64: eight machines
    assert layout(setup.runs["baseline 405B (Table 3) calibrated"]).decode.cost.k4 > \
        layout(wide).decode.cost.k4
