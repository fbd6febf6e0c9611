"""DecoderConfig validation, HF config translation and loader errors."""

import json

import numpy as np
import pytest
import transformers

from fnrl.models.decoder import DecoderConfig, Llama3RopeScaling
from fnrl.models.hf_io import init_model, load_pretrained, save_pretrained

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("field,value", [
    ("vocab_size", 0),
    ("hidden_size", -64),
    ("intermediate_size", 1.5),
    ("num_hidden_layers", 0),
    ("num_key_value_heads", 3),  # 4 heads not divisible by 3
    ("head_dim", 7),             # RoPE needs an even head_dim
    ("rope_theta", 0.0),
    ("rms_norm_eps", -1e-6),
    ("tie_word_embeddings", 1),
    ("eos_token_id", -1),
    ("max_position_embeddings", True),
    ("model_type", "mistral"),
    ("rope_scaling", {"rope_type": "llama3"}),  # a dict, not a Llama3RopeScaling
])
def test_bad_value_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        DecoderConfig(**{**BASE, field: value})


def test_head_dim_defaults_to_hidden_over_heads():
    assert DecoderConfig(**BASE).head_dim == 16
    assert DecoderConfig(**BASE, head_dim=8).head_dim == 8
    with pytest.raises(ValueError, match="hidden_size"):
        DecoderConfig(**{**BASE, "hidden_size": 66})


def test_from_hf_reads_transformers_config_and_ignores_unknown_keys():
    hf = transformers.Qwen2Config(**BASE, rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6},
                                  tie_word_embeddings=True, eos_token_id=[5, 6]).to_dict()
    cfg = DecoderConfig.from_hf(hf)
    assert cfg.rope_theta == 1e6 and cfg.tie_word_embeddings and cfg.eos_token_id == (5, 6)
    legacy = {**BASE, "rope_theta": 5e5, "num_key_value_heads": None, "unknown_key": 1}
    assert DecoderConfig.from_hf(legacy).rope_theta == 5e5
    assert DecoderConfig.from_hf(legacy).num_key_value_heads == 4


def test_from_hf_names_missing_keys_and_rejects_unsupported():
    with pytest.raises(ValueError, match="hidden_size.*num_hidden_layers"):
        DecoderConfig.from_hf({k: v for k, v in BASE.items()
                             if k not in ("hidden_size", "num_hidden_layers")})
    with pytest.raises(ValueError, match="use_sliding_window"):
        DecoderConfig.from_hf({**BASE, "use_sliding_window": True})
    with pytest.raises(ValueError, match="RoPE"):
        DecoderConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("key,value,model_type", [
    ("use_sliding_window", True, "qwen3"),
    ("layer_types", ["full_attention", "sliding_attention"], "qwen2"),
    ("hidden_act", "gelu", "llama"),
    ("mlp_bias", True, "llama"),
    ("attention_bias", True, "llama"),
    ("attention_bias", True, "qwen3"),
    ("pretraining_tp", 2, "llama"),
    ("partial_rotary_factor", 0.5, "llama"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "llama"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "qwen3"),
    ("model_type", "qwen2_moe", "qwen2"),
])
def test_from_hf_refuses_unsupported_features_naming_the_key(key, value, model_type):
    hf = {**BASE, "model_type": model_type, key: value}
    with pytest.raises(ValueError, match=key):
        DecoderConfig.from_hf(hf)


def test_from_hf_reads_each_family_from_transformers():
    qwen3 = transformers.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True).to_dict()
    cfg = DecoderConfig.from_hf(qwen3)
    assert (cfg.model_type, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", 32, True, False)
    llama = transformers.LlamaConfig(**BASE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}).to_dict()
    cfg = DecoderConfig.from_hf(llama)
    assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias, cfg.rope_theta) == ("llama", False, False, 5e5)
    assert cfg.rope_scaling == Llama3RopeScaling(factor=32.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0,
                                                 original_max_position_embeddings=1024)
    qwen2 = DecoderConfig.from_hf(transformers.Qwen2Config(**BASE).to_dict())
    assert (qwen2.model_type, qwen2.qkv_bias, qwen2.qk_norm) == ("qwen2", True, False)


def test_from_hf_reads_a_legacy_llama31_config_json():
    """Llama 3.1's config.json as published (transformers 4 spelling: top-level
    rope_theta, rope_scaling with rope_type, eos a list)."""
    legacy = {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
              "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "vocab_size": 128256}
    cfg = DecoderConfig.from_hf(legacy)
    assert cfg.eos_token_id == (128001, 128008, 128009) and cfg.eos_token_ids == cfg.eos_token_id
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.original_max_position_embeddings == 8192
    assert cfg.head_dim == 128 and cfg.rms_norm_eps == 1e-5
    assert DecoderConfig.from_hf({k: v for k, v in legacy.items() if k != "model_type"}) == cfg


def test_llama3_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(**{**BASE, "num_attention_heads": 2}, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=512)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = DecoderConfig.from_hf(hf.to_dict()).rope_inv_freq()
    assert attention_factor == 1.0
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    plain = DecoderConfig.from_hf({**hf.to_dict(), "rope_parameters": None, "rope_theta": 5e5})
    changed = ~np.isclose(ours, plain.rope_inv_freq())
    assert changed.any() and not changed.all()  # some bands scaled, the fastest kept


@pytest.mark.parametrize("field,value", [("factor", 0.0), ("high_freq_factor", 0.5),
                                         ("original_max_position_embeddings", 0)])
def test_llama3_scaling_validates(field, value):
    good = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    with pytest.raises(ValueError, match=field):
        Llama3RopeScaling(**{**good, field: value})


@pytest.mark.parametrize("model_type,arch", [("qwen2", "Qwen2ForCausalLM"),
                                             ("qwen3", "Qwen3ForCausalLM"),
                                             ("llama", "LlamaForCausalLM")])
def test_to_hf_names_each_family_for_transformers(model_type, arch):
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)
    cfg = DecoderConfig(**BASE, model_type=model_type, head_dim=32, rope_theta=5e5,
                        max_position_embeddings=512, eos_token_id=(5, 6),
                        rope_scaling=scaling if model_type == "llama" else None)
    hf = json.loads(json.dumps(cfg.to_hf("bfloat16")))
    assert hf["architectures"] == [arch] and hf["model_type"] == model_type
    assert DecoderConfig.from_hf(hf) == cfg
    theirs = transformers.AutoConfig.for_model(**hf)
    assert type(theirs).__name__ == arch.replace("ForCausalLM", "Config")
    assert theirs.rope_parameters["rope_theta"] == 5e5 and theirs.head_dim == 32
    assert theirs.eos_token_id == [5, 6]
    if model_type == "llama":
        assert theirs.rope_parameters["rope_type"] == "llama3"
        assert theirs.rope_parameters["factor"] == 8.0


def test_to_hf_round_trips_and_transformers_reads_it():
    cfg = DecoderConfig(**BASE, head_dim=8, rope_theta=1e6, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=(2, 3), pad_token_id=0)
    hf = cfg.to_hf()
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["model_type"] == "qwen2"
    assert DecoderConfig.from_hf(json.loads(json.dumps(hf))) == cfg
    theirs = transformers.AutoConfig.for_model(**hf)
    assert theirs.rope_parameters["rope_theta"] == 1e6
    assert (theirs.head_dim, theirs.num_key_value_heads, theirs.tie_word_embeddings) == (8, 2, True)


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(DecoderConfig(**BASE).to_hf()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)


def test_wrong_tensor_shape_is_named(tmp_path):
    cfg = DecoderConfig(**BASE, tie_word_embeddings=True)
    _, params = init_model(cfg, 0)
    save_pretrained(tmp_path / "ckpt", cfg, params)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**cfg.to_hf(), "vocab_size": 98}))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        load_pretrained(tmp_path / "ckpt")
    save_pretrained(tmp_path / "ckpt", cfg, params)  # replaces the existing directory
    (tmp_path / "ckpt" / "config.json").write_text(
        json.dumps({**cfg.to_hf(), "tie_word_embeddings": False}))
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_pretrained(tmp_path / "ckpt")


def test_save_copies_tokenizer_files_and_leaves_no_temp_dirs(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    cfg = DecoderConfig(**BASE)
    _, params = init_model(cfg, 0)
    out = save_pretrained(tmp_path / "ckpt", cfg, params, tokenizer_dir=tok)
    assert {p.name for p in out.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"}
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        save_pretrained(tmp_path / "ckpt", cfg, params, tokenizer_dir=tmp_path / "nothing")
    assert (out / "tokenizer.json").exists()  # a failed save leaves the old checkpoint intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "tok"]
