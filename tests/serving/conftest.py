"""A tiny random Qwen2 model directory, a real relay and a real vLLM server.

End-to-end tests can copy these fixtures: `fnrl.models.synthetic.write_checkpoint` writes
everything vLLM needs to load a model (config, safetensors, tokenizer files, generation
config).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from fnrl.relay.launch import launch_relay, stop_relay, wait_relay_ready
from fnrl.shell.net import free_port
from fnrl.serving.server import ServerSpec, serve, stop_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, char_tokenizer_dir) -> Path:
    """The small float32 Qwen2 (synthetic.SMALL_SHAPES: head_dim 32, which vLLM's CPU
    attention supports, 512 positions) with the character tokenizer. Untied, so
    lm_head.weight is a tensor of its own to swap; drawn at init_std 0.1, above HF's
    0.02, so next-token distributions are peaked and greedy decoding has clear winners."""
    from fnrl.models.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-qwen2") / "model", "qwen2", seed=0,
                            tokenizer_dir=char_tokenizer_dir, init_std=0.1,
                            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def relay_address(tmp_path_factory):
    """Address of a real relay process, stopped (segments unlinked) after the module."""
    name = f"t{uuid.uuid4().hex[:10]}"
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = launch_relay(address, name, tmp_path_factory.mktemp("relay") / "relay.log")
    try:
        wait_relay_ready(address, proc)
        yield address
    finally:
        stop_relay(proc, name)


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    """Base URL of a real vLLM server on the tiny model, stopped after the module."""
    # --enable-scale-out: vLLM's token endpoint too, which routing replay streams from.
    spec = ServerSpec(
        model_dir=str(tiny_model_dir), port=free_port(), max_model_len=256, max_num_seqs=64,
        extra_args=("--enable-scale-out",)
    )
    log_path = tmp_path_factory.mktemp("server") / "vllm.log"
    spec, proc = serve(spec, log_path, timeout_s=300)
    try:
        yield spec.base_url
    finally:
        stop_server(proc)
