"""DecoderConfig validation, HF config translation and loader errors."""

import json

import pytest
import transformers

from fnrl.models.hf_io import init_model, load_pretrained, save_pretrained
from fnrl.models.decoder import DecoderConfig

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
