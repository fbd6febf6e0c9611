"""The trainer's memory figures, against hand-computed ones for a tiny model."""

import dataclasses

import pytest

from fnrl.config import AlgoConfig, LoraConfig, TrainerConfig
from fnrl.models.decoder import ATTENTION_BLOCK, DecoderConfig
from fnrl.trainer.memory import (ATTENTION_BLOCK_COPIES, PROCESS_BYTES, PROCESS_BYTES_PER_PARAM,
                                 adapter_param_count, adapted_param_count,
                                 activation_bytes_per_token_layer, param_count, trainer_memory)

# V=100, E=8, I=16, 2 layers, H=2 heads, K=1 kv head, D=4, tied, Qwen2 (q/k/v biases).
TINY = DecoderConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                     tie_word_embeddings=True)


def test_param_count_by_hand():
    # embedding 100*8; per layer: 2 norms 2*8, q 8*2*4 + 8, k and v 8*4 + 4 each,
    # o 2*4*8, MLP 3*8*16 = 608; final norm 8.
    assert param_count(TINY) == 800 + 2 * 608 + 8 == 2024


def test_float32_unchunked_figures_by_hand():
    tm = trainer_memory(TINY, TrainerConfig(), AlgoConfig(), rows=4, length=8)
    n = 2024
    process = PROCESS_BYTES + PROCESS_BYTES_PER_PARAM * n
    assert dict(tm.resident) == {"params": 4 * n, "Adam moments": 8 * n, "process": process}
    # Per token and layer: (4*8 + 2*(2+2*1)*4 + 2*4 + 8*16) * 4 bytes + RoPE's float32
    # q and k (2+1)*4*4 = 848; attention: 2 heads * 8 keys * 2 float32 arrays * 4 = 128.
    assert dict(tm.backward) == {"gradients": 4 * n, "tied embedding's second gradient": 100 * 8 * 4,
                                 "activations (all layers, 32 tokens)": 2 * 32 * (848 + 128),
                                 "logits (32 tokens x 100)": 2 * 32 * 100 * 4}
    assert dict(tm.update) == {"gradients": 4 * n, "AdamW temporaries": 12 * n}
    assert dict(tm.save) == {"checkpoint copy of the state": 12 * n,
                             "weights for the relay": 4 * n}
    backward = 4 * n + 3200 + 62464 + 25600
    assert tm.step_peak_bytes == 12 * n + process + backward
    # The save's host copies come on top of the step's peak (measured on the 0.5B run).
    assert tm.peak_bytes == tm.step_peak_bytes + 16 * n


def test_chunks_remat_bf16_micro_batches_and_kl_by_hand():
    trainer = TrainerConfig(logprob_chunk=4, remat=True, compute_dtype="bfloat16",
                            micro_batches=2)
    tm = trainer_memory(TINY, trainer, AlgoConfig(kl_coef=0.1), rows=4, length=8,
                        serve_dtype="bfloat16")
    n = 2024
    assert dict(tm.resident)["KL reference weights"] == 2 * n
    backward = dict(tm.backward)
    # A micro-batch: 2 rows x 8 = 16 tokens; a chunk: 2 rows x (4 // 2) positions.
    # bf16 per token and layer: (32 + 32 + 8 + 128) * 2 + 48 = 448, attention (float32)
    # 2*8*2*4 = 128: 576, 9,216 for 16 tokens. Remat keeps the 2 layers' inputs (8 * 2
    # bytes a token) and one recomputed layer; its scan stacks the layers' 2 * 608
    # parameters and their gradients in the compute dtype (bfloat16).
    assert backward["activations (remat, 16 tokens)"] == 2 * 16 * 8 * 2 + 9216
    assert backward["layers' parameters and gradients stacked for the scan"] == 2 * 1216 * 2
    # Chunked: the fused backward carries the V x E kernel gradient in float32.
    assert backward["vocabulary kernel's float32 gradient carry"] == 100 * 8 * 4
    assert backward["logits (4 tokens x 100)"] == 2 * 4 * 100 * 4
    assert backward["gradient accumulator"] == 4 * n and backward["weights in bfloat16"] == 2 * n
    assert dict(tm.update) == {"gradients": 4 * n, "gradient accumulator": 4 * n,
                               "AdamW temporaries": 12 * n}
    assert dict(tm.save)["weights for the relay"] == 2 * n
    # The backward pass (10 n + 24,192 bytes) outweighs the update (20 n = 40,480).
    backward = 4 * n + 4 * n + 3200 + 2 * n + 9728 + 4864 + 3200 + 3200
    assert backward == 44432
    process = PROCESS_BYTES + PROCESS_BYTES_PER_PARAM * n
    assert tm.step_peak_bytes == 12 * n + 2 * n + process + backward


@pytest.mark.parametrize("chunk", [0, 1024])
def test_chunks_shrink_the_logits_of_a_qwen_sized_vocabulary(chunk):
    qwen = DecoderConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True)
    backward = dict(trainer_memory(qwen, TrainerConfig(logprob_chunk=chunk), AlgoConfig(),
                                   rows=8, length=1024).backward)
    tokens = 8 * 1024 if chunk == 0 else 1024
    assert backward[f"logits ({tokens} tokens x 151936)"] == 2 * tokens * 151936 * 4


def test_long_sequences_keep_no_attention_scores_per_layer():
    """Past one attention block the layers keep no T-wide scores: one block's scores
    exist at a time, so activations grow linearly in T, not quadratically."""
    qwen = DecoderConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True)
    acts = {}
    for length in (ATTENTION_BLOCK, 4 * ATTENTION_BLOCK):
        backward = dict(trainer_memory(qwen, TrainerConfig(), AlgoConfig(), rows=8,
                                       length=length).backward)
        acts[length] = backward[f"activations (all layers, {8 * length} tokens)"]
    per_token = activation_bytes_per_token_layer(qwen, 4 * ATTENTION_BLOCK, 4)
    block_scores = ATTENTION_BLOCK_COPIES * 8 * 14 * ATTENTION_BLOCK * 4 * ATTENTION_BLOCK * 4
    assert acts[4 * ATTENTION_BLOCK] == 24 * 8 * 4 * ATTENTION_BLOCK * per_token + block_scores
    assert per_token < activation_bytes_per_token_layer(qwen, ATTENTION_BLOCK, 4)


def test_the_plan_covers_the_measured_real_run():
    """The 0.5B-shaped run (lab/benchmarks/real_model.py: bfloat16, 4 x 1,152 tokens, chunks
    of 512, remat) peaked at 12.89 GiB RSS in the trainer, 0.92 GiB of it the relay's
    inbox mapped in; its step alone (fnrl.trainer.peak) at 9.71 GB. The plan must cover
    both, and by no more than a quarter (a plan far above the truth refuses runs that fit)."""
    qwen = DecoderConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True)
    trainer = TrainerConfig(logprob_chunk=512, remat=True, compute_dtype="bfloat16",
                            param_dtype="bfloat16")
    tm = trainer_memory(qwen, trainer, AlgoConfig(), rows=4, length=1152,
                        serve_dtype="bfloat16")
    gib = 2**30
    assert 9.71e9 <= tm.step_peak_bytes <= 1.25 * 9.71e9
    assert 12.89 * gib <= tm.peak_bytes <= 1.25 * (12.89 - 0.92) * gib
    small = trainer_memory(TINY, TrainerConfig(), AlgoConfig(), rows=4, length=8)
    assert dict(small.resident)["process"] == PROCESS_BYTES + PROCESS_BYTES_PER_PARAM * 2024


def test_a_mixture_of_experts_keeps_its_top_k_experts_and_its_routing_per_token():
    """Per token and layer a MoE keeps k experts' activations (k x moe_intermediate_size
    wide, where a dense model keeps intermediate_size) plus the router's float32
    probabilities over every expert and its k gathered inputs and outputs."""
    from fnrl.trainer.memory import saved_dots_bytes_per_token_layer

    dense = DecoderConfig(model_type="qwen3", vocab_size=256, hidden_size=64,
                          intermediate_size=1000, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1)
    moe = DecoderConfig(**{**dataclasses.asdict(dense), "model_type": "qwen3_moe",
                           "intermediate_size": 1000, "num_experts": 8,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 48})
    as_dense = dataclasses.replace(dense, intermediate_size=2 * 48)
    routing = lambda c: 8 * 4 + 2 * 2 * 64 * c   # noqa: E731
    for c in (2, 4):
        assert (activation_bytes_per_token_layer(moe, 128, c)
                == activation_bytes_per_token_layer(as_dense, 128, c) + routing(c))
        assert (saved_dots_bytes_per_token_layer(moe, c)
                == saved_dots_bytes_per_token_layer(as_dense, c) + routing(c))


def test_device_plan_splits_weights_over_fsdp_and_rows_over_data():
    """One accelerator's share under FSDP: parameter-sized arrays / (fsdp x tensor),
    activations and logits / (data x fsdp), and no host process."""
    from fnrl.config import MeshConfig
    plain = TrainerConfig(compute_dtype="float32", remat="none", attention="xla")
    one = trainer_memory(TINY, plain, AlgoConfig(), rows=8, length=8, device=True)
    assert "process" not in dict(one.resident)
    sharded = dataclasses.replace(plain, mesh=MeshConfig(data=2, fsdp=2, tensor=1))
    four = trainer_memory(TINY, sharded, AlgoConfig(), rows=8, length=8, device=True)
    assert dict(four.resident)["params"] == dict(one.resident)["params"] // 2
    acts = [k for k in dict(one.backward) if k.startswith("activations")][0]
    assert dict(four.backward)[acts] == dict(one.backward)[acts] // 4


def test_lora_figures_by_hand():
    """Rank 2 on q and down of TINY: q's A 8x2 + B 2x(2x4), down's A 16x2 + B 2x8, per
    layer 16 + 16 + 32 + 16 = 80, so 160 adapter parameters; they alone are optimised,
    checkpointed and published, and the base (2,024) is frozen in bfloat16 (the compute
    dtype), with no KL reference beside it."""
    lora = LoraConfig(rank=2, targets=("q_proj", "down_proj"))
    assert adapter_param_count(TINY, lora) == 160
    assert adapted_param_count(TINY, lora) == 2 * (8 * 8 + 16 * 8)
    trainer = TrainerConfig(compute_dtype="bfloat16", lora=lora)
    tm = trainer_memory(TINY, trainer, AlgoConfig(kl_coef=0.1), rows=4, length=8)
    n, t = 2024, 160
    resident = dict(tm.resident)
    assert resident["frozen base (bfloat16)"] == 2 * n and resident["LoRA adapters"] == 4 * t
    assert resident["Adam moments"] == 8 * t and "KL reference weights" not in resident
    backward = dict(tm.backward)
    assert backward["gradients"] == 4 * t and "tied embedding's second gradient" not in backward
    assert "weights in bfloat16" not in backward   # the base is held in it already
    assert dict(tm.update) == {"gradients": 4 * t, "AdamW temporaries": 12 * t}
    assert dict(tm.save) == {"checkpoint copy of the state": 12 * t,
                             "adapters for the relay": 4 * t}
