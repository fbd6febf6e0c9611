"""Conversion between fnrl Qwen2 params and Hugging Face checkpoints.

`params` everywhere is the pure nested dict `nnx.to_pure_dict(nnx.split(model)[1])`
(see `fnrl.models.decoder`); an `nnx.State` is accepted too. Loaders return numpy host
arrays so the caller chooses placement: `jax.device_put(params, shardings)`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from fnrl.models.decoder import DecoderConfig, abstract_model, init_model

__all__ = ["params_to_hf", "hf_to_params", "load_pretrained", "save_pretrained", "init_model"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")

# (HF name, fnrl path, HF shape, fnrl -> HF, HF -> fnrl)
_Entry = tuple[str, tuple, tuple[int, ...], Callable, Callable]


def _same(x):
    return x


def _table(cfg: DecoderConfig) -> list[_Entry]:
    """Every tensor's name, location and layout change, in one place."""
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    # HF Linear weights are [out, in]; fnrl kernels are [in, ...out] with heads kept apart.
    def proj_in(n):  # E×n×D <-> (n·D)×E
        return lambda w: w.reshape(E, n * D).T, lambda w: w.T.reshape(E, n, D)

    def bias(n):  # n×D <-> (n·D,)
        return lambda b: b.reshape(n * D), lambda b: b.reshape(n, D)

    o_to = lambda w: w.reshape(H * D, E).T  # H×D×E -> E×(H·D)
    o_from = lambda w: w.T.reshape(H, D, E)
    table = [("model.embed_tokens.weight", ("embedding",), (V, E), _same, _same)]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", ("layers", i)
        table += [
            (hf + "input_layernorm.weight", (*p, "input_norm", "scale"), (E,), _same, _same),
            (hf + "self_attn.q_proj.weight", (*p, "attn", "q_kernel"), (H * D, E), *proj_in(H)),
            (hf + "self_attn.q_proj.bias", (*p, "attn", "q_bias"), (H * D,), *bias(H)),
            (hf + "self_attn.k_proj.weight", (*p, "attn", "k_kernel"), (K * D, E), *proj_in(K)),
            (hf + "self_attn.k_proj.bias", (*p, "attn", "k_bias"), (K * D,), *bias(K)),
            (hf + "self_attn.v_proj.weight", (*p, "attn", "v_kernel"), (K * D, E), *proj_in(K)),
            (hf + "self_attn.v_proj.bias", (*p, "attn", "v_bias"), (K * D,), *bias(K)),
            (hf + "self_attn.o_proj.weight", (*p, "attn", "o_kernel"), (E, H * D), o_to, o_from),
            (hf + "post_attention_layernorm.weight", (*p, "post_attn_norm", "scale"), (E,),
             _same, _same),
            (hf + "mlp.gate_proj.weight", (*p, "mlp", "gate_kernel"), (I, E), np.transpose,
             np.transpose),
            (hf + "mlp.up_proj.weight", (*p, "mlp", "up_kernel"), (I, E), np.transpose,
             np.transpose),
            (hf + "mlp.down_proj.weight", (*p, "mlp", "down_kernel"), (E, I), np.transpose,
             np.transpose),
        ]
    table.append(("model.norm.weight", ("final_norm", "scale"), (E,), _same, _same))
    if not cfg.tie_word_embeddings:
        table.append(("lm_head.weight", ("lm_head",), (V, E), np.transpose, np.transpose))
    return table


def params_to_hf(cfg: DecoderConfig, params, *, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named, HF-layout contiguous numpy tensors in `dtype` (float32 by default).

    Pure numpy after one host transfer per leaf; `lm_head.weight` only when untied.
    """
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    out = {}
    for hf_name, path, _, to_hf, _ in _table(cfg):
        leaf = params
        for key in path:
            leaf = leaf[key]
        out[hf_name] = np.ascontiguousarray(to_hf(np.asarray(leaf)), dtype=dtype)
    return out


def hf_to_params(cfg: DecoderConfig, tensors: Mapping[str, np.ndarray], *,
                 dtype=np.float32) -> dict:
    """Pure-dict params (numpy leaves in `dtype`) from HF tensors; extra tensors are ignored."""
    params: dict = {}
    for hf_name, path, shape, _, from_hf in _table(cfg):
        if hf_name not in tensors:
            raise KeyError(f"checkpoint is missing tensor {hf_name!r}")
        tensor = tensors[hf_name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.ascontiguousarray(from_hf(np.asarray(tensor)), dtype=dtype)
    return params


def _read_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        if not (model_dir / name).exists():
            raise FileNotFoundError(f"missing weights file {model_dir / name}")
        tensors.update(load_file(model_dir / name))
    return tensors


def load_pretrained(model_dir: str | os.PathLike, *, dtype=jnp.float32,
                    param_dtype=jnp.float32) -> tuple[DecoderConfig, nnx.GraphDef, dict]:
    """Reads `config.json` and (possibly sharded) safetensors into (cfg, graphdef, params).

    `dtype`/`param_dtype` are the model's compute and storage dtypes; params are numpy.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"missing {config_path}")
    cfg = DecoderConfig.from_hf(json.loads(config_path.read_text()))
    graphdef, _ = abstract_model(cfg, dtype=dtype, param_dtype=param_dtype)
    params = hf_to_params(cfg, _read_tensors(model_dir), dtype=np.dtype(param_dtype))
    return cfg, graphdef, params


def _generation_config(cfg: DecoderConfig) -> dict:
    # Token ids only: vLLM adopts sampling defaults (top_k, temperature, ...) from this file,
    # which would silently change the RL sampling distribution.
    ids = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                            else cfg.eos_token_id)}
    return {k: v for k, v in ids.items() if v is not None}


def save_pretrained(model_dir: str | os.PathLike, cfg: DecoderConfig, params, *,
                    tokenizer_dir: str | os.PathLike | None = None, dtype=np.float32) -> Path:
    """Writes an HF checkpoint directory (config, safetensors, generation config, tokenizer).

    Written into a sibling temp dir and renamed into place, so readers never see a partial
    checkpoint; an existing `model_dir` is replaced.
    """
    model_dir = Path(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype)
    tmp = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=f".{model_dir.name}.tmp"))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype.name), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2))
        save_file(params_to_hf(cfg, params, dtype=dtype), tmp / "model.safetensors",
                  metadata={"format": "pt"})  # transformers refuses files without it
        if tokenizer_dir is not None:
            found = [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).exists()]
            if not found:
                raise FileNotFoundError(f"no tokenizer files {TOKENIZER_FILES} in {tokenizer_dir}")
            for name in found:
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        if model_dir.exists():
            old = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=f".{model_dir.name}.old"))
            os.replace(model_dir, old / "ckpt")
            os.replace(tmp, model_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model_dir
