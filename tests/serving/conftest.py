"""A tiny random Qwen2 model directory, a real relay and a real vLLM server.

End-to-end tests can copy these fixtures: `build_tiny_qwen2` writes everything vLLM
needs to load a model (config, safetensors, tokenizer.json, tokenizer_config.json).
"""

from __future__ import annotations

import json
import string
import uuid
from pathlib import Path

import pytest

from fnrl.relay.launch import launch_relay, stop_relay, wait_relay_ready
from fnrl.shell.net import free_port
from fnrl.serving.server import ServerSpec, serve, stop_server

SPECIAL_TOKENS = ("<pad>", "<eos>")
PAD_ID, EOS_ID = 0, 1


def build_tiny_qwen2(
    model_dir: Path,
    *,
    vocab_size: int = 64,
    hidden_size: int = 64,
    num_layers: int = 2,
    init_std: float = 0.1,
    seed: int = 0,
) -> Path:
    """A random float32 Qwen2 with a one-character-per-token tokenizer.

    head_dim is 32 (hidden 64, 2 heads): vLLM's CPU attention supports head sizes
    32, 64, 80, ... but not 16. `init_std` above HF's 0.02 makes next-token
    distributions peaked, so greedy decoding has clear winners to compare.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_dir.mkdir(parents=True, exist_ok=True)
    chars = list(string.ascii_lowercase + string.digits + " .,+-*/=()?!")
    tokens = [*SPECIAL_TOKENS, *chars]
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, "<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "model_max_length": 512,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


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
    spec = ServerSpec(
        model_dir=str(tiny_model_dir), port=free_port(), max_model_len=256, max_num_seqs=64
    )
    log_path = tmp_path_factory.mktemp("server") / "vllm.log"
    spec, proc = serve(spec, log_path, timeout_s=300)
    try:
        yield spec.base_url
    finally:
        stop_server(proc)
