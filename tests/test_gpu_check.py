"""The GPU lane: numerics whose tolerance depends on the platform (marked `gpu`, run by
scripts/gpu_check.sh with FNRL_GPU_LANE=1 on the device, and on CPU here), the report's
target logic, and the script itself end to end on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import assert_close, tol

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.models.attention import attend
from fnrl.models.decoder import DecoderConfig, forward, init_model
from fnrl.models.synthetic import SMALL_SHAPES, random_params

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_report  # noqa: E402

VOCAB = 256


def _cfg(**kw) -> DecoderConfig:
    return DecoderConfig(**{**SMALL_SHAPES["qwen2"], "vocab_size": VOCAB, **kw})


@pytest.mark.gpu
def test_the_trainer_resolves_its_defaults_for_the_device_it_finds():
    from fnrl.trainer.memory import resolve_for_device

    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    tc, why = resolve_for_device(TrainerConfig(), platform=device.platform, model=_cfg(),
                                 algo=AlgoConfig(), rows=2, length=64, device_bytes=limit)
    got = (tc.compute_dtype, tc.attention, tc.remat, tc.matmul_precision)
    if device.platform == "gpu":
        # A tiny model's plan fits any card: the least recomputation, none, is chosen.
        assert limit and limit > 2**30, device.memory_stats()
        assert got == ("bfloat16", "cudnn", "none", "default"), why
        assert "of the card" in why["remat"]
    else:
        assert got == ("float32", "xla", "none", "highest"), why
    assert {"compute_dtype", "attention", "remat", "matmul_precision"} <= set(why)


@pytest.mark.gpu
def test_remat_policies_give_the_plain_gradients_at_full_float32_precision():
    """The H200 fact: at the default precision (TF32) remat and plain gradients differed
    by 1.4e-4; at "highest", what float32 compute resolves to, they agree to float32."""
    cfg = _cfg(num_hidden_layers=3)
    params = random_params(cfg, 0, init_std=0.1, perturb_std=0.2)
    tokens_BxT = np.random.default_rng(0).integers(0, VOCAB, (2, 33)).astype(np.int32)

    def grads(remat):
        graphdef, _ = init_model(cfg, 0, remat=remat, attention="xla")

        def loss(p):
            logits_BxTxV = forward(graphdef, p, tokens_BxT[:, :-1])
            logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, -1)
            return jnp.mean(jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], -1))
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.grad(loss))(params)

    plain = grads("none")
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(plain)) > 1e-3
    for remat in ("dots", "full"):
        jax.tree.map(lambda a, b: assert_close(a, b, "float32", err_msg=remat), grads(remat),
                     plain)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_the_platforms_attention_kernel_in_bfloat16_matches_float32(packed):
    """cuDNN's fused kernel on a GPU (xla on CPU) in bfloat16 against the xla kernel in
    float32: output and every input gradient, plain and packed rows (the padding tail's
    positions carry no cotangent)."""
    kernel = "cudnn" if jax.default_backend() == "gpu" else "xla"
    B, T, H, K, D = 2, 128, 4, 2, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(keys[0], (B, T, H, D)), jax.random.normal(keys[1], (B, T, K, D)),
               jax.random.normal(keys[2], (B, T, K, D)))
    seg = None
    live_BxT = np.ones((B, T), np.float32)
    if packed:
        seg = np.zeros((B, T), np.int32)
        seg[0, :50], seg[0, 50:110] = 1, 2        # two sequences and 18 positions of padding
        seg[1, :] = 1
        live_BxT = (seg > 0).astype(np.float32)
        seg = jnp.asarray(seg)
    cotangent = jax.random.normal(keys[3], (B, T, H, D)) * live_BxT[:, :, None, None]

    def run(kernel, dtype):
        def f(q, k, v):
            out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype), kernel=kernel,
                         segment_ids_BxT=seg, max_segments=4 if packed else 0)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out
        with jax.default_matmul_precision("highest"):
            (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
                q, k, v)
        return out, grads

    want_out, want_grads = run("xla", jnp.float32)
    got_out, got_grads = run(kernel, jnp.bfloat16)
    assert got_out.dtype == jnp.bfloat16
    live = live_BxT[:, :, None, None]
    assert_close(got_out * live, want_out * live, "bfloat16", err_msg=f"{kernel} output")
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert_close(g, w, "bfloat16", err_msg=f"{kernel} d{name}")


@pytest.mark.slow   # compiles full steps in two dtypes: the GPU lane's and the whole suite's
@pytest.mark.gpu
def test_a_train_step_with_this_platforms_kernels_in_bfloat16_tracks_float32():
    """One PPO step in bfloat16 with the kernels the platform resolves to (cuDNN and
    remat "dots" on a GPU) against the float32 reference kernels at full precision."""
    from fnrl.trainer.peak import random_batch
    from fnrl.trainer.platform import model_kernels, resolve_trainer
    from fnrl.trainer.step import compile_train_step, init_state, make_optimizer

    cfg = _cfg()
    algo = AlgoConfig(learning_rate=1e-5)
    fast, _ = resolve_trainer(TrainerConfig(compute_dtype="bfloat16"),
                              platform=jax.default_backend(), model=cfg)
    ref = TrainerConfig(compute_dtype="float32", remat="none", attention="xla",
                        matmul_precision="highest")
    params = random_params(cfg, 0, init_std=0.1)
    batch = dict(random_batch(2, 64, VOCAB), adv_B=np.ones(2, np.float32))  # loss near -1
    metrics = {}
    for name, tc in (("fast", fast), ("ref", ref)):
        graphdef, _ = init_model(cfg, 0, dtype=jnp.dtype(tc.compute_dtype), **model_kernels(tc))
        optimizer = make_optimizer(algo)
        step = compile_train_step(graphdef, optimizer, algo, None, None,
                                  logprob_chunk=tc.logprob_chunk,
                                  matmul_precision=tc.matmul_precision)
        _, metrics[name] = step(init_state(jax.tree.map(jnp.copy, params), optimizer), batch)
    for key in ("loss", "grad_norm"):
        assert float(metrics["ref"][key]) != 0.0
        assert_close(metrics["fast"][key], metrics["ref"][key], "bfloat16", err_msg=key)


def test_tolerances_widen_from_cpu_float32_to_tf32_to_bfloat16():
    cpu, gpu = tol("float32", on="cpu"), tol("float32", on="gpu")
    tf32, bf16 = tol("float32", on="gpu", precision="default"), tol("bfloat16")
    assert cpu["rtol"] < gpu["rtol"] < tf32["rtol"] < bf16["rtol"]
    with pytest.raises(ValueError, match="float16"):
        tol("float16")


def _bench(ratio=None, fnrl=None, torch=None) -> dict:
    fnrl = fnrl or {"mfu": 0.45, "peak_device_gb": 60.0, "xla_plan_gb": 58.0,
                    "fnrl_plan_gb": 55.0, "device": "NVIDIA H200"}
    torch = torch or {"mfu": 0.3}
    return {"summary": {"sides": {"fnrl": fnrl, "torch": torch},
                        "ratios": {"torch": {"median": ratio}} if ratio else {}}}


def test_the_report_meets_misses_or_sets_aside_each_target():
    ev = gpu_report.evaluate
    assert ev("qwen0.5b", _bench(ratio=1.35), "gpu")["status"] == "met"
    assert ev("qwen0.5b", _bench(ratio=1.05), "gpu")["status"] == "missed"
    assert ev("qwen1.5b", _bench(fnrl={"error": "x", "kind": "oom"}), "gpu")["status"] == (
        "missed: fnrl failed (oom)")
    assert ev("qwen1.5b", _bench(torch={"error": "x", "kind": "oom"}), "gpu")["status"] == (
        "n/a: torch failed (oom)")
    three = ev("qwen3b", _bench(), "gpu")
    assert (three["status"], three["peak_device_gb"], three["xla_plan_gb"]) == ("met", 60.0, 58.0)
    assert ev("qwen3b", _bench(), "gpu", ran=False)["status"] == "not run"
    assert ev("qwen3b", _bench(), "cpu")["status"].startswith("n/a: targets are for a GPU")


def test_the_report_counts_out_of_memory_as_a_result_and_anything_else_as_an_error():
    oom = _bench(ratio=None, torch={"error": "RESOURCE_EXHAUSTED", "kind": "oom"})
    assert gpu_report.bench_errors("qwen3b", 0, oom) == []
    crash = _bench(fnrl={"error": "Traceback\nTypeError: bad", "kind": "error"})
    assert gpu_report.bench_errors("qwen3b", 0, crash) == [
        "qwen3b: fnrl failed (error): TypeError: bad"]
    assert gpu_report.bench_errors("qwen3b", 1, None) == [
        "qwen3b: benchmark exited 1, no result written"]
    assert gpu_report.test_summary("...\nFAILED tests/x.py::t - boom\n1 failed, 3 passed in 2s"
                                   )["counts"] == {"failed": 1, "passed": 3}


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_and_writes_one_report(tmp_path):
    """The whole lane in its CPU-quick form: gpu tests (one file of them: the suite runs
    every gpu test on CPU already), the benchmark in turns (the GPU schedule) on a
    one-layer model, and the report with its targets set aside."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OUT")}
    env.update(PYTHON=sys.executable, FNRL_GPU_CHECK_QUICK="1", JAX_PLATFORMS="cpu",
               FNRL_GPU_CHECK_TEST_FILES="tests/trainer/test_logprobs.py",
               # The suite's quick CPU compiles (tests/conftest.py), without its 8 devices.
               XLA_FLAGS="--xla_backend_optimization_level=0")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    text = (tmp_path / "gpu_check.md").read_text()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert text.startswith("# fnrl GPU check: PASS")
    assert report["platform"] == "cpu" and report["errors"] == []
    assert report["tests"]["rc"] == 0 and report["tests"]["counts"]["passed"] >= 5
    assert "failed" not in report["tests"]["counts"]
    cpu = report["benchmarks"]["cpu"]
    assert cpu["schedule"] == "turns" and cpu["config"]["num_hidden_layers"] == 1
    fnrl = cpu["summary"]["sides"]["fnrl"]
    assert fnrl["xla_plan_gb"] > 0 and fnrl["fnrl_plan_gb"] > 0
    assert "compute_dtype=float32" in fnrl["kernels"]
    assert cpu["summary"]["ratios"]["torch"]["median"] > 0
    assert "| cpu | 1L × 256, 2 × 32 | fnrl |" in text and "fnrl/torch tokens/s" in text
    assert all(t["status"].startswith("n/a") for t in report["targets"])
    assert set(report["timings"]) == {"tests", "cpu", "total"}
