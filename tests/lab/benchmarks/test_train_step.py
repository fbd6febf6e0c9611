"""lab/benchmarks/train_step.py: the presets are the real Qwen2.5 configs, the FLOP count
gives the recorded H200 MFU, a side out of memory is a result in the table, and the
paced (CPU) schedule still runs end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
from lab.benchmarks import train_step

from fnrl.models.decoder import DecoderConfig
from fnrl.trainer.memory import param_count


def _model(preset: str) -> DecoderConfig:
    return DecoderConfig(**{k: v for k, v in train_step.PRESETS[preset].items()
                            if k not in train_step._NOT_MODEL})


@pytest.mark.parametrize("preset,params", [
    ("qwen0.5b", 494_032_768), ("qwen1.5b", 1_543_714_304), ("qwen3b", 3_085_938_688),
    # Qwen2.5-7B's 7,615,616,512 less 20 of its layers of 233,057,792 parameters.
    ("qwen7b-8l", 2_954_460_672)])
def test_presets_have_the_parameter_counts_of_the_hf_models(preset, params):
    assert param_count(_model(preset)) == params
    p = train_step.PRESETS[preset]
    assert (p["batch"], p["seq"]) == ((8, 1024) if preset == "qwen0.5b" else (8, 2048))


def test_the_flop_count_gives_the_mfu_recorded_on_the_h200():
    # ARCHITECTURE.md: Qwen2.5-0.5B at 8 x 1,024, 131.8 ms a step, MFU 20.3 %.
    p = train_step.PRESETS["qwen0.5b"]
    assert train_step.matmul_params(p) == 493_961_216   # all but embedding (tied), norms, biases
    per_token = train_step.model_flops_per_token(p)
    assert per_token == 6 * 493_961_216 + 12 * 24 * 1024 * 896
    assert train_step.model_flops_per_token(p, causal=True) == per_token - 6 * 24 * 1024 * 896
    mfu = per_token * 8 * 1024 / 0.1318 / train_step.peak_flops("NVIDIA H200")
    assert mfu == pytest.approx(0.203, abs=5e-4)


def test_peak_flops_go_by_the_card_name():
    assert train_step.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert train_step.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert train_step.peak_flops("NVIDIA H200") == 989e12
    assert train_step.peak_flops("cpu") is None


def test_failures_out_of_memory_are_told_from_other_errors():
    kind = train_step.failure_kind
    assert kind("jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating") == "oom"
    assert kind("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") == "oom"
    assert kind("TypeError: compile_train_step() got an unexpected keyword") == "error"


def _side(ms: float, **kw) -> dict:
    return {"step_s": [ms / 1e3] * 3, "cpu_s": [ms / 1e3] * 3, "first_call_s": 9.0,
            "device": "NVIDIA H200", "platform": "gpu", "peak_device_mb": 20_000.0,
            "peak_rss_mb": 3_000.0, "kernels": "k", **kw}


_FNRL = dict(xla_plan={"argument": 10, "output": 10, "alias": 10, "temp": 5, "peak": 15e9,
                       "generated_code": 0},
             fnrl_plan_step_peak=14e9, compile_s=30.0, device_limit_mb=100_000.0,
             trainer={"remat": "dots"})


def test_the_summary_puts_a_side_out_of_memory_in_the_table_and_keeps_the_other():
    p = train_step.PRESETS["qwen0.5b"]
    both = train_step.round_record(("fnrl", "torch"), {"fnrl": _side(100.0, **_FNRL),
                                                       "torch": _side(150.0)})
    oom = train_step.round_record(("torch", "fnrl"), {
        "fnrl": _side(110.0, **_FNRL),
        "torch": {"error": "torch.OutOfMemoryError: CUDA out of memory", "kind": "oom"}})
    assert both["ratio"] == pytest.approx(1.5) and oom["ratio"] is None
    summary = train_step.summarize([both, oom], p)
    fnrl = summary["sides"]["fnrl"]
    assert fnrl["ms_per_step"] == pytest.approx(105.0)
    assert fnrl["mfu"] == pytest.approx(
        train_step.model_flops_per_token(p) * 8192 / 0.105 / 989e12)
    assert (fnrl["xla_plan_gb"], fnrl["fnrl_plan_gb"]) == (15.0, 14.0)
    assert summary["sides"]["torch"]["rounds_failed"] == 1
    assert summary["ratios"]["torch"]["values"] == pytest.approx((1.5,))
    table = "\n".join(train_step.table_lines(summary))
    assert "fnrl/torch tokens per second: median 1.50" in table
    assert "XLA plan 15.0 GB" in table and "peak_bytes_in_use 21.0 GB (1.40× XLA's plan)" in table

    only_oom = train_step.summarize([oom], p)
    assert only_oom["sides"]["torch"] == {"error": "torch.OutOfMemoryError: CUDA out of memory",
                                          "kind": "oom"}
    assert only_oom["ratios"] == {}
    assert "failed: oom" in "\n".join(train_step.table_lines(only_oom))


@pytest.mark.slow
def test_paced_rounds_still_run_on_cpu(tmp_path):
    """The CPU schedule end to end on a one-layer model: both processes alive, steps
    interleaved, a ratio of wall and of CPU time."""
    out = tmp_path / "paced.json"
    done = subprocess.run(
        [sys.executable, "-m", "lab.benchmarks.train_step", "--preset", "cpu", "--layers", "1",
         "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1", "--rounds", "1",
         "--platform", "cpu", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schedule"] == "paced" and len(result["rounds"]) == 1
    assert result["rounds"][0]["cpu_ratio"] > 0
    assert "ratio of CPU time per step, torch/fnrl" in done.stdout
