"""Hub-free fixtures: the Qwen-style BPE tokenizer and random checkpoints of each family."""

import json

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from fnrl.data.arith import BOS, EOS, PAD, build_tokenizer
from fnrl.models.decoder import DecoderConfig, abstract_model
from fnrl.models.hf_io import check_model_dir, load_pretrained, read_generation_config
from fnrl.models.synthetic import (CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START, QWEN25_05B,
                                   build_bpe_tokenizer, math_corpus, write_checkpoint)

# Qwen2.5-0.5B's config.json as published on the hub.
QWEN25_05B_CONFIG_JSON = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokenizer_loads_with_qwen_special_tokens_and_chat_template(tok_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    n = len(tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)}
    assert sorted(ids.values()) == [n - 3, n - 2, n - 1]  # after the learnt vocab, as Qwen
    assert tok.eos_token == tok.pad_token == ENDOFTEXT and tok.bos_token is None
    assert tok.eos_token_id == tok.pad_token_id == ids[ENDOFTEXT]
    assert n > 400  # merges were learnt beyond the 256 bytes

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 12 + 30?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text.startswith(without) and not without.endswith("assistant\n")
    encoded = tok(text, add_special_tokens=True)["input_ids"]
    assert encoded[0] == ids[IM_START] and encoded.count(ids[IM_END]) == 2  # one id each
    assert tok.decode(encoded) == text  # nothing added, nothing lost


def test_tokenizer_round_trips_math_text_and_splits_digits(tok_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in ["Natalia sold 48 clips.\n#### 72", "The answer is $\\boxed{\\frac{3}{4}}$.",
                 "Ünïcode & émojis 🙂 still round-trip: bytes, not unknowns."]:
        assert tok.decode(tok(text)["input_ids"]) == text
    pieces = tok.convert_ids_to_tokens(tok("#### 1234")["input_ids"])
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "2", "3", "4"]
    # Frequent corpus words became single tokens.
    assert len(tok("####")["input_ids"]) == 1 and len(tok(" answer")["input_ids"]) == 1
    assert tok.convert_ids_to_tokens(tok("\\boxed{7}")["input_ids"])[1] == "boxed"


def test_tokenizer_config_is_what_vllm_and_transformers_read(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == ENDOFTEXT and config["additional_special_tokens"] == [
        IM_START, IM_END]
    assert len(math_corpus(50, seed=1)) == 50 and math_corpus(5) == math_corpus(5)
    with pytest.raises(ValueError, match="vocab_size"):
        build_bpe_tokenizer(tok_dir / "small", vocab_size=100)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_write_checkpoint_is_complete_for_each_family(tmp_path, tok_dir, family):
    out = write_checkpoint(tmp_path / family, family, seed=0, tokenizer_dir=tok_dir)
    check_model_dir(out)
    cfg, _, params = load_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert cfg.model_type == family
    assert cfg.vocab_size % 64 == 0 and len(tok) <= cfg.vocab_size < len(tok) + 64
    im_end, eot = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)
    assert read_generation_config(out)["eos_token_id"] == [im_end, eot]
    assert cfg.bos_token_id == cfg.eos_token_id == cfg.pad_token_id == eot  # Qwen's base config
    assert out.joinpath("tokenizer_config.json").exists()
    std = np.std(params["layers"][0]["mlp"]["up_kernel"])
    assert 0.015 < std < 0.025  # fnrl's own init, HF's initializer_range


def test_write_checkpoint_options(tmp_path, tok_dir):
    out = write_checkpoint(tmp_path / "big", "qwen2", seed=1, tokenizer_dir=tok_dir,
                           dtype="bfloat16", shard_bytes=50_000, init_std=0.1,
                           perturb_std=0.2, hidden_size=128, num_hidden_layers=3,
                           vocab_size=1024)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]) == (128, 3, 1024)
    assert hf["torch_dtype"] == "bfloat16" and (out / "model.safetensors.index.json").exists()
    _, _, params = load_pretrained(out)
    assert 0.08 < np.std(params["layers"][0]["mlp"]["up_kernel"]) < 0.12
    assert np.std(params["layers"][0]["attn"]["q_bias"]) > 0.1  # perturbed, not zero
    # Without a tokenizer one is built (and its temp dir removed).
    alone = write_checkpoint(tmp_path / "alone", "llama", seed=0)
    check_model_dir(alone)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "big"]
    with pytest.raises(ValueError, match="family"):
        write_checkpoint(tmp_path / "x", "mistral", seed=0, tokenizer_dir=tok_dir)
    with pytest.raises(ValueError, match="vocab_size"):
        write_checkpoint(tmp_path / "x", "qwen2", seed=0, tokenizer_dir=tok_dir, vocab_size=64)


def test_write_checkpoint_takes_the_ids_its_tokenizer_names(tmp_path, char_tokenizer_dir):
    """fnrl's character tokenizer (no Qwen specials): the config's bos/eos/pad are the
    ones its tokenizer_config.json names, generation_config.json repeats them, and the
    vocabulary is padded to the multiple asked for."""
    out = write_checkpoint(tmp_path / "tiny", "qwen2", seed=0, tokenizer_dir=char_tokenizer_dir,
                           vocab_multiple=16)
    check_model_dir(out)
    cfg, _, _ = load_pretrained(out)
    tok = build_tokenizer()
    ids = {role: tok.token_to_id(t) for role, t in (("bos", BOS), ("eos", EOS), ("pad", PAD))}
    assert len(set(ids.values())) == 3
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        ids["bos"], ids["eos"], ids["pad"])
    assert read_generation_config(out) == {f"{role}_token_id": i for role, i in ids.items()}
    assert tok.get_vocab_size() == 99 and cfg.vocab_size == 112  # 128 at the default 64
    with pytest.raises(ValueError, match="vocab_multiple"):
        write_checkpoint(tmp_path / "x", "qwen2", seed=0, tokenizer_dir=char_tokenizer_dir,
                         vocab_multiple=0)


def test_qwen25_05b_is_the_real_shape():
    """The published config.json reads into exactly QWEN25_05B, 494,032,768 parameters
    (Qwen2.5-0.5B's count), computed without allocating them."""
    real = DecoderConfig.from_hf(QWEN25_05B_CONFIG_JSON)
    ours = DecoderConfig(**QWEN25_05B, bos_token_id=151643, eos_token_id=151643)
    assert real == ours
    _, state = abstract_model(ours)
    assert sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(state))) == 494_032_768


def test_shared_fixture_builds_each_family_once(synthetic_model_dir):
    qwen3 = synthetic_model_dir("qwen3")
    assert synthetic_model_dir("qwen3") == qwen3
    assert synthetic_model_dir("qwen3", init_std=0.1) != qwen3
    assert load_pretrained(qwen3)[0].model_type == "qwen3"
