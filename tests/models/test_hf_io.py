"""Checkpoint directories: sharded and bfloat16 writing, reading back, and the checks a
job runs on a model directory before anything starts."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file

from fnrl.models.decoder import DecoderConfig, forward
from fnrl.models.hf_io import (check_model_dir, load_pretrained, params_to_hf,
                               read_generation_config, save_pretrained, weight_files)
from fnrl.models.synthetic import random_params, write_checkpoint

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)


def _cfg(model_type="qwen3", **kw):
    return DecoderConfig(**{**SMALL, "model_type": model_type, "tie_word_embeddings": False, **kw})


def _hf_logits(model_dir, tokens_BxT, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens_BxT)).logits.float().numpy()


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], shape).astype(np.int32)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_sharded_write_reads_back_bit_exact_and_loads_in_transformers(tmp_path, model_type):
    cfg = _cfg(model_type)
    params = random_params(cfg, 1, init_std=0.15, perturb_std=0.2)
    max_shard_bytes = 64 * 160 * 4 * 2 + 1  # two MLP kernels per shard at most
    out = save_pretrained(tmp_path / "ckpt", cfg, params, max_shard_bytes=max_shard_bytes)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert not (out / "model.safetensors").exists()
    assert len(shards) > 4 and shards == [p.name for p in weight_files(out)]
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        tensors = load_file(out / shard)
        size = sum(t.nbytes for t in tensors.values())
        assert size <= max_shard_bytes or len(tensors) == 1  # only an oversized tensor alone
        assert {index["weight_map"][n] for n in tensors} == {shard}
        total += size
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(params_to_hf(cfg, params))

    loaded_cfg, graphdef, loaded = load_pretrained(out)
    assert loaded_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, params))
    tokens_BxT = _tokens((2, 12))
    np.testing.assert_allclose(np.asarray(forward(graphdef, loaded, tokens_BxT)),
                               _hf_logits(out, tokens_BxT), rtol=0, atol=1e-4)


def test_streamed_file_equals_what_the_safetensors_library_writes(tmp_path):
    """fnrl writes safetensors itself (one tensor in memory at a time); the library
    reads it back tensor for tensor, with the metadata transformers requires."""
    cfg = _cfg("qwen2")
    params = random_params(cfg, 2, init_std=0.15, perturb_std=0.2)
    for dtype in ("float32", "bfloat16"):
        out = save_pretrained(tmp_path / dtype, cfg, params, dtype=dtype)
        with safe_open(out / "model.safetensors", framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            read = {name: f.get_tensor(name) for name in f.keys()}
        expected = params_to_hf(cfg, params, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16"
                                else np.float32)
        assert read.keys() == expected.keys()
        for name, tensor in expected.items():
            assert read[name].dtype == tensor.dtype
            np.testing.assert_array_equal(read[name], tensor)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_bfloat16_export_loads_in_transformers(tmp_path, model_type):
    cfg = _cfg(model_type, tie_word_embeddings=model_type == "qwen2")
    params = random_params(cfg, 3, init_std=0.15, perturb_std=0.2)
    out = save_pretrained(tmp_path / "bf16", cfg, params, dtype=jnp.bfloat16)
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["torch_dtype"] == hf_config["dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < 0.55 * sum(
        t.nbytes for t in params_to_hf(cfg, params).values())
    # The bf16 file holds our params rounded to bf16: with those, logits agree in float32.
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                           params)
    cfg_back, graphdef, loaded = load_pretrained(out)  # into float32 params
    assert cfg_back == cfg
    jax.tree.map(np.testing.assert_array_equal, loaded, rounded)
    tokens_BxT = _tokens((2, 10))
    ours_BxTxV = np.asarray(forward(graphdef, loaded, tokens_BxT))
    np.testing.assert_allclose(ours_BxTxV, _hf_logits(out, tokens_BxT), rtol=0, atol=1e-4)
    # transformers' default for this file is bf16 compute: close, not equal.
    theirs16 = _hf_logits(out, tokens_BxT, dtype=torch.bfloat16)
    assert np.abs(theirs16 - ours_BxTxV).mean() < 0.05 * np.abs(ours_BxTxV).mean()


def test_bfloat16_checkpoint_loads_into_bfloat16_params_without_a_float32_copy(tmp_path):
    cfg = _cfg("llama")
    params = random_params(cfg, 4, init_std=0.15)
    out = save_pretrained(tmp_path / "bf16", cfg, params, dtype="bfloat16")
    _, graphdef, loaded = load_pretrained(out, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(loaded))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b).astype(a.dtype)),
                 loaded, params)
    logits = np.asarray(forward(graphdef, loaded, _tokens((1, 6))))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def test_missing_and_incomplete_model_dirs_are_named(tmp_path):
    tok = tmp_path / "tok"
    model = write_checkpoint(tmp_path / "model", "qwen3", seed=0, shard_bytes=200_000)
    check_model_dir(model)  # complete: no error
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_dir(tmp_path / "nothing")
    tok.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        check_model_dir(tok)

    index = json.loads((model / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (model / last).rename(tmp_path / last)
    with pytest.raises(FileNotFoundError, match=last):
        check_model_dir(model)
    (tmp_path / last).rename(model / last)

    (model / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        check_model_dir(model)
    (tmp_path / "tokenizer.json").rename(model / "tokenizer.json")

    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window"):
        check_model_dir(model)
    (model / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="model.layers.2"):
        check_model_dir(model)
    (model / "config.json").write_text(json.dumps(hf))

    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        check_model_dir(model)
    (model / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        check_model_dir(model)


def test_generation_config_is_read_or_none(tmp_path):
    model = write_checkpoint(tmp_path / "model", "llama", seed=0)
    generation = read_generation_config(model)
    eos = generation["eos_token_id"]
    assert isinstance(eos, list) and len(eos) == 2
    (model / "generation_config.json").unlink()
    assert read_generation_config(model) is None
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        read_generation_config(model)


def test_save_writes_a_given_generation_config_and_rejects_bad_shard_sizes(tmp_path):
    cfg = _cfg("qwen2")
    params = random_params(cfg, 0)
    given = {"eos_token_id": [2, 3], "temperature": 0.7, "top_p": 0.8}
    out = save_pretrained(tmp_path / "ckpt", cfg, params, generation_config=given)
    assert read_generation_config(out) == given
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_pretrained(tmp_path / "ckpt", cfg, params, max_shard_bytes=0)
    with pytest.raises(ValueError, match="float64"):
        save_pretrained(tmp_path / "ckpt2", cfg, params, dtype=np.float64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dirs left
