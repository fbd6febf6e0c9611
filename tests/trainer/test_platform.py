"""Platform defaults: every "auto" of TrainerConfig made concrete, with its reason."""

import dataclasses

import pytest

from fnrl.config import AlgoConfig, LoraConfig, TrainerConfig
from fnrl.models.decoder import DecoderConfig
from fnrl.models.synthetic import QWEN25_05B
from fnrl.trainer.memory import resolve_for_device
from fnrl.trainer.platform import describe, model_kernels, resolve_trainer, storage_dtype

_FIELDS = {f.name for f in dataclasses.fields(DecoderConfig)}
QWEN = DecoderConfig(**{k: v for k, v in QWEN25_05B.items() if k in _FIELDS})
GIB = 2**30


def test_cpu_keeps_the_float32_path():
    tc, why = resolve_trainer(TrainerConfig(), platform="cpu", model=QWEN)
    assert (tc.compute_dtype, tc.attention, tc.remat, tc.matmul_precision) == (
        "float32", "xla", "none", "highest")
    assert "needs a GPU" in why["attention"]
    assert tc.logprob_chunk > 0   # chunked log-probs on every platform


def test_gpu_picks_bfloat16_cudnn_and_the_least_remat_that_fits_the_card():
    kw = dict(platform="gpu", model=QWEN, algo=AlgoConfig(), rows=8, length=1024)
    tc, why = resolve_for_device(TrainerConfig(), device_bytes=80 * GIB, **kw)
    assert (tc.compute_dtype, tc.attention, tc.remat, tc.matmul_precision) == (
        "bfloat16", "cudnn", "none", "default")
    assert "72.0 GiB of the card" in why["remat"]
    line = describe(tc, why)
    assert "attention=cudnn (auto: GPU: cuDNN fused flash attention)" in line
    assert "remat=none (auto: gpu: plan " in line and "param_dtype=float32" in line
    # Smaller cards: keep the matmuls' outputs, then only each layer's input.
    assert resolve_for_device(TrainerConfig(), device_bytes=24 * GIB, **kw)[0].remat == "dots"
    small, why = resolve_for_device(TrainerConfig(), device_bytes=16 * GIB, **kw)
    assert small.remat == "full" and "14.4 GiB of the card" in why["remat"]
    # Too small even for full remat: chosen, and said (not refused: the plan estimates).
    tiny, why = resolve_for_device(TrainerConfig(), device_bytes=10 * GIB, **kw)
    assert tiny.remat == "full" and "even with full remat, above 9.0 GiB" in why["remat"]
    # Without a plan (no model or card size) an accelerator keeps the matmuls' outputs.
    assert resolve_trainer(TrainerConfig(), platform="gpu")[0].remat == "dots"


def test_explicit_choices_are_kept_and_cudnn_is_refused_in_float32():
    tc, why = resolve_trainer(TrainerConfig(compute_dtype="float32", remat="full"),
                              platform="gpu", model=QWEN)
    assert tc.attention == "xla" and "bfloat16/float16" in why["attention"]
    assert tc.matmul_precision == "highest"   # no TF32 when float32 is asked for
    assert tc.remat == "full" and "remat" not in why
    odd = dataclasses.replace(QWEN, head_dim=12)
    assert resolve_trainer(TrainerConfig(), platform="gpu", model=odd)[0].attention == "xla"


def test_kernels_need_a_resolved_config_and_packing_bounds_the_runs():
    with pytest.raises(ValueError, match="resolve_trainer first"):
        model_kernels(TrainerConfig())
    tc, _ = resolve_trainer(TrainerConfig(pack_rows=4, pack_max_segments=16), platform="cpu")
    assert model_kernels(tc) == {"remat": "none", "attention": "xla", "max_segments": 16,
                                 "lora": None}
    lora = LoraConfig(rank=4)
    tc, _ = resolve_trainer(TrainerConfig(lora=lora), platform="cpu")
    assert model_kernels(tc)["lora"] == lora
    assert storage_dtype(tc) == "float32"   # the base in the compute dtype (auto)
    assert storage_dtype(dataclasses.replace(tc, lora=LoraConfig(rank=4, base_dtype="bfloat16"))
                         ) == "bfloat16"
    assert storage_dtype(dataclasses.replace(tc, lora=LoraConfig())) == tc.param_dtype
    with pytest.raises(ValueError, match="platform must be one of"):
        resolve_trainer(TrainerConfig(), platform="metal")


def test_config_names_bad_values_and_reads_old_booleans():
    assert TrainerConfig(remat=True).remat == "full"
    assert TrainerConfig(remat=False).remat == "none"
    with pytest.raises(ValueError, match="TrainerConfig.attention='flash'"):
        TrainerConfig(attention="flash")
    with pytest.raises(ValueError, match="pack_max_segments"):
        TrainerConfig(pack_max_segments=1)
