"""KV cache sizing and the host-memory check made before a vLLM server starts
(no server starts here)."""

from __future__ import annotations

import json

import pytest

from fnrl.config import RolloutConfig
from fnrl.serving import server
from fnrl.serving.server import (SERVER_PROCESS_BYTES, HostMemory, ServerMemory, ServerSpec,
                                 check_fits, check_memory, kv_bytes_per_token,
                                 kv_reservation_bytes, server_command, server_memory)

GiB = 2**30
# The test model of tests/serving/conftest.py: 2 layers, hidden 64, 2 heads, 1 KV head.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "torch_dtype": "float32"}
# Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 heads, 2 KV heads.
QWEN_05B = {"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
            "num_key_value_heads": 2, "torch_dtype": "bfloat16"}


def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(TINY, "float32") == 2 * 2 * 1 * 32 * 4 == 512
    assert kv_bytes_per_token(QWEN_05B, "bfloat16") == 24 * 2 * 2 * 64 * 2 == 12288
    assert kv_bytes_per_token(QWEN_05B, "auto") == 12288  # the checkpoint's dtype
    assert kv_bytes_per_token(QWEN_05B, "float32") == 24576  # the served dtype wins
    # An explicit head_dim (Qwen3: 16 heads of 128 on a 1024-wide model) is not hidden/heads.
    qwen3 = {**QWEN_05B, "hidden_size": 1024, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128}
    assert kv_bytes_per_token(qwen3, "bfloat16") == 24 * 2 * 8 * 128 * 2
    # No num_key_value_heads: multi-head attention, one KV head per head.
    mha = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert kv_bytes_per_token(mha, "float16") == 2 * 2 * 2 * 32 * 2
    # Multimodal configs nest the language model's.
    assert kv_bytes_per_token({"text_config": TINY}, "float32") == 512
    with pytest.raises(ValueError, match="int8"):
        kv_bytes_per_token(TINY, "int8")


def test_kv_reservation_in_whole_blocks_with_spare_and_null_block():
    # 64 sequences x 2 blocks of 128 tokens = 128 blocks; +10% = 140.8 -> 141; +1 null.
    assert kv_reservation_bytes(bytes_per_token=512, max_num_seqs=64,
                                max_model_len=256) == 142 * 128 * 512 == 9_306_112
    # A context shorter than a block still takes a whole one: 256 -> 282 (281.6) + 1.
    assert kv_reservation_bytes(bytes_per_token=512, max_num_seqs=256,
                                max_model_len=32) == 283 * 128 * 512
    # 257 tokens need a third block.
    assert kv_reservation_bytes(bytes_per_token=1, max_num_seqs=10, max_model_len=257,
                                spare_percent=0) == (30 + 1) * 128
    # 100 blocks + 10% is 110 exactly (100 * 1.1 in floats is 110.00000000000001).
    assert kv_reservation_bytes(bytes_per_token=1, max_num_seqs=100,
                                max_model_len=128) == 111 * 128
    # The main job's scale: 256 x 1024 tokens of Qwen2.5-0.5B in bfloat16 is 3.3 GiB.
    qwen = kv_reservation_bytes(bytes_per_token=12288, max_num_seqs=256, max_model_len=1024)
    assert qwen == (2253 + 1) * 128 * 12288 and 3.3 < qwen / GiB < 3.4


def memory(available_gib: float, node_available_gib: float) -> HostMemory:
    return HostMemory(total_bytes=24 * GiB, available_bytes=int(available_gib * GiB),
                      node_total_bytes=8 * GiB, node_available_bytes=int(node_available_gib * GiB))


def test_check_fits_names_every_figure():
    servers = [ServerMemory(model_dir="/models/a", needed_bytes=6 * GiB,
                            vllm_checked_bytes=4 * GiB, detail="KV 4.00 GiB"),
               ServerMemory(model_dir="/models/b", needed_bytes=5 * GiB,
                            vllm_checked_bytes=3 * GiB, detail="KV 3.00 GiB")]
    check_fits(servers, memory(11, 7))
    # Each alone would fit in 10 GiB of the host, or 6 of node 0; together they do not.
    for short in (memory(10, 7), memory(11, 6)):
        with pytest.raises(ValueError) as err:
            check_fits(servers, short)
        message = str(err.value)
        for figure in ("need 11.00 GiB", "7.00 GiB of it checked by vLLM",
                       f"{short.available_bytes / GiB:.2f} GiB of 24.00 GiB on the host",
                       f"{short.node_available_bytes / GiB:.2f} GiB of 8.00 GiB on node 0",
                       "/models/a: 6.00 GiB (KV 4.00 GiB)", "/models/b: 5.00 GiB",
                       "--rollout.max-num-seqs", "--rollout.kv-memory-fraction"):
            assert figure in message, (figure, message)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_text("{}")  # not weights
    return tmp_path


def spec(model_dir, **kwargs) -> ServerSpec:
    return ServerSpec(model_dir=str(model_dir), port=1, max_model_len=256, max_num_seqs=64,
                      **kwargs)


def test_server_memory_counts_kv_weights_and_process(model_dir):
    need = server_memory(spec(model_dir), memory(20, 6))
    assert need.needed_bytes == 9_306_112 + 1000 + SERVER_PROCESS_BYTES
    assert need.vllm_checked_bytes == 9_306_112
    assert "max_num_seqs=64 x max_model_len=256" in need.detail
    # An explicit fraction is vLLM's budget for the whole process, of node 0's total.
    need = server_memory(spec(model_dir, kv_memory_fraction=0.25), memory(20, 6))
    assert need.needed_bytes == need.vllm_checked_bytes == 2 * GiB
    assert "kv_memory_fraction=0.25" in need.detail


def test_command_reserves_the_sized_kv_unless_a_fraction_is_given(model_dir):
    command = server_command(spec(model_dir))
    assert command[command.index("--kv-cache-memory-bytes") + 1] == "9306112"
    assert "--gpu-memory-utilization" not in command
    command = server_command(spec(model_dir, kv_memory_fraction=0.3))
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.3"
    assert "--kv-cache-memory-bytes" not in command


def test_launch_refuses_before_starting_when_memory_is_short(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(server, "kv_in_host_memory", lambda: True)
    monkeypatch.setattr(server, "read_host_memory", lambda: memory(1.5, 6))
    log = tmp_path / "vllm.log"
    with pytest.raises(ValueError, match=f"(?s)need 1.81 GiB.*{model_dir}.*1.50 GiB of 24"):
        server.launch_server(spec(model_dir), log)
    assert not log.exists()  # nothing was started
    with pytest.raises(ValueError, match="kv_memory_fraction=0.25"):  # 2 GiB of node 0
        check_memory([spec(model_dir, kv_memory_fraction=0.25)])
    check_memory([spec(model_dir, kv_memory_fraction=0.25)], memory(20, 6))


def test_a_gpu_build_of_vllm_is_not_checked_against_host_memory(model_dir, monkeypatch):
    monkeypatch.setattr(server, "kv_in_host_memory", lambda: False)
    check_memory([spec(model_dir)], memory(0, 0))


def test_host_memory_is_read():
    now = server.read_host_memory()
    assert 0 < now.available_bytes <= now.total_bytes
    assert 0 < now.node_available_bytes <= now.node_total_bytes


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_out_of_range_is_refused(model_dir, fraction):
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        spec(model_dir, kv_memory_fraction=fraction)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        RolloutConfig(kv_memory_fraction=fraction)
    assert RolloutConfig().kv_memory_fraction == 0.0  # sized by default
