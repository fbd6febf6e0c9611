"""A vLLM server's GPUs: its argv carries the tensor-parallel size, and its environment
the GPUs the launcher gave it (fnrl.serving.server)."""

import dataclasses
import json
import os

import pytest

from fnrl.serving.server import ServerSpec, server_command, server_env


def test_the_server_spans_its_tensor_parallel_gpus(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}))
    spec = ServerSpec(model_dir=str(tmp_path), port=1, max_model_len=64, max_num_seqs=2)
    assert server_command(spec)[server_command(spec).index("--tensor-parallel-size") + 1] == "1"
    argv = server_command(dataclasses.replace(spec, tensor_parallel_size=4))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    # No GPUs given: the environment's as it is (CPU, or the local backend).
    assert server_env(spec).get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert server_env(dataclasses.replace(spec, visible_devices="2,3"))[
        "CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        dataclasses.replace(spec, tensor_parallel_size=0)
