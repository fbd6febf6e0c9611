"""Conversion between fnrl decoder params and Hugging Face checkpoint directories.

`params` everywhere is the pure nested dict `nnx.to_pure_dict(nnx.split(model)[1])`
(see `fnrl.models.decoder`); an `nnx.State` is accepted too. Loaders return numpy host
arrays so the caller chooses placement: `jax.device_put(params, shardings)`.

A checkpoint directory holds `config.json`, the weights as `model.safetensors` or as
shards named by `model.safetensors.index.json`, the tokenizer files and, optionally,
`generation_config.json`. Reading and writing go one tensor at a time, so peak host
memory is the params plus one tensor (plus, for a mixture of experts, one stacked expert
kernel), never the params twice.

A Qwen3-MoE checkpoint holds the Hub's layout: the router as `mlp.gate.weight` (X×E)
and each expert as its own `mlp.experts.{e}.{gate,up,down}_proj.weight`. fnrl stacks
the experts into one X×... kernel per projection; transformers 5 fuses gate and up on
load and splits them again on save, and vLLM's loader maps each expert by name, so this
one layout is what all three read and write.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from fnrl.models.checkpoint_files import INDEX_FILE, SINGLE_FILE, lazy_tensors, weight_files
from fnrl.models.decoder import DecoderConfig, abstract_model, init_model
from fnrl.models.lora import init_adapters, join
from fnrl.shell.files import read_json_if_present

__all__ = ["TOKENIZER_FILES", "check_model_dir", "hf_to_params", "init_model",
           "iter_hf_tensors", "load_pretrained", "params_to_hf", "read_generation_config",
           "save_pretrained", "weight_files"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


class _Entry(NamedTuple):
    """One HF tensor: its name, the fnrl leaf it lives in, its HF shape, the layout
    changes each way and, for one expert of a stacked kernel, the expert's index into
    the leaf's first axis."""

    hf_name: str
    path: tuple
    hf_shape: tuple[int, ...]
    to_hf: Callable
    from_hf: Callable
    expert: int | None = None


def _same(x):
    return x


def _np_dtype(dtype) -> np.dtype:
    """numpy dtype of a name, numpy or jax dtype; "bfloat16" is ml_dtypes'."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _table(cfg: DecoderConfig) -> list[_Entry]:
    """Every tensor's name, location and layout change, per family, in one place."""
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    # HF Linear weights are [out, in]; fnrl kernels are [in, ...out] with heads kept apart.
    def proj_in(n):  # E×n×D <-> (n·D)×E
        return lambda w: w.reshape(E, n * D).T, lambda w: w.T.reshape(E, n, D)

    def bias(n):  # n×D <-> (n·D,)
        return lambda b: b.reshape(n * D), lambda b: b.reshape(n, D)

    o_to = lambda w: w.reshape(H * D, E).T  # H×D×E -> E×(H·D)
    o_from = lambda w: w.T.reshape(H, D, E)
    table = [_Entry("model.embed_tokens.weight", ("embedding",), (V, E), _same, _same)]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}.", ("layers", i)
        attn = [(hf + "self_attn.q_proj.weight", (*p, "attn", "q_kernel"), (H * D, E),
                 *proj_in(H)),
                (hf + "self_attn.k_proj.weight", (*p, "attn", "k_kernel"), (K * D, E),
                 *proj_in(K)),
                (hf + "self_attn.v_proj.weight", (*p, "attn", "v_kernel"), (K * D, E),
                 *proj_in(K)),
                (hf + "self_attn.o_proj.weight", (*p, "attn", "o_kernel"), (E, H * D),
                 o_to, o_from)]
        if cfg.qkv_bias:
            attn += [(hf + f"self_attn.{x}_proj.bias", (*p, "attn", f"{x}_bias"), (n * D,),
                      *bias(n)) for x, n in (("q", H), ("k", K), ("v", K))]
        if cfg.qk_norm:
            attn += [(hf + f"self_attn.{x}_norm.weight", (*p, "attn", f"{x}_norm", "scale"),
                      (D,), _same, _same) for x in ("q", "k")]
        table += [
            (hf + "input_layernorm.weight", (*p, "input_norm", "scale"), (E,), _same, _same),
            *attn,
            (hf + "post_attention_layernorm.weight", (*p, "post_attn_norm", "scale"), (E,),
             _same, _same),
            *(_moe_entries(cfg, hf, p) if cfg.is_moe else [
                (hf + "mlp.gate_proj.weight", (*p, "mlp", "gate_kernel"), (I, E), np.transpose,
                 np.transpose),
                (hf + "mlp.up_proj.weight", (*p, "mlp", "up_kernel"), (I, E), np.transpose,
                 np.transpose),
                (hf + "mlp.down_proj.weight", (*p, "mlp", "down_kernel"), (E, I), np.transpose,
                 np.transpose)]),
        ]
    table.append(("model.norm.weight", ("final_norm", "scale"), (E,), _same, _same))
    if not cfg.tie_word_embeddings:
        table.append(("lm_head.weight", ("lm_head",), (V, E), np.transpose, np.transpose))
    return [_Entry(*entry) for entry in table]


def _moe_entries(cfg: DecoderConfig, hf: str, p: tuple) -> list[_Entry]:
    """A layer's router and experts. Grouped by projection (every expert's gate, then
    every up, then every down) so consecutive entries share a stacked leaf, which
    `iter_hf_tensors` then brings to host once."""
    E, X, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    entries = [_Entry(hf + "mlp.gate.weight", (*p, "moe", "router_kernel"), (X, E),
                      np.transpose, np.transpose)]
    for proj, shape in (("gate", (I, E)), ("up", (I, E)), ("down", (E, I))):
        path = (*p, "moe", f"{proj}_kernel")
        entries += [_Entry(f"{hf}mlp.experts.{e}.{proj}_proj.weight", path, shape,
                           np.transpose, np.transpose, expert=e) for e in range(X)]
    return entries


def iter_hf_tensors(cfg: DecoderConfig, params, *, dtype=np.float32
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, HF-layout contiguous numpy tensor in `dtype`), one leaf at a time: a
    caller that writes or sends each before taking the next holds one tensor on host."""
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    dtype = _np_dtype(dtype)
    host_path, host = None, None
    for entry in _table(cfg):
        if entry.path != host_path:  # the experts of one kernel share a host copy
            leaf = params
            for key in entry.path:
                leaf = leaf[key]
            host_path, host = entry.path, np.asarray(leaf)
        tensor = host if entry.expert is None else host[entry.expert]
        yield entry.hf_name, np.ascontiguousarray(entry.to_hf(tensor), dtype=dtype)


def params_to_hf(cfg: DecoderConfig, params, *, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named, HF-layout contiguous numpy tensors in `dtype` (float32 by default).

    Pure numpy after one host transfer per leaf; `lm_head.weight` only when untied.
    """
    return dict(iter_hf_tensors(cfg, params, dtype=dtype))


def hf_to_params(cfg: DecoderConfig, tensors: Mapping[str, np.ndarray], *,
                 dtype=np.float32) -> dict:
    """Pure-dict params (numpy leaves in `dtype`) from HF tensors; extra tensors are ignored.

    `tensors` may be lazy (a mapping that reads on access): each is read, converted
    and dropped before the next.
    """
    dtype = _np_dtype(dtype)
    params: dict = {}
    for hf_name, path, shape, _, from_hf, expert in _table(cfg):
        if hf_name not in tensors:
            raise KeyError(f"checkpoint is missing tensor {hf_name!r}")
        tensor = tensors[hf_name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        value = np.ascontiguousarray(from_hf(np.asarray(tensor)), dtype=dtype)
        if expert is None:
            node[path[-1]] = value
        else:  # one expert's slice of the stacked kernel, allocated at its first expert
            if path[-1] not in node:
                node[path[-1]] = np.empty((cfg.num_experts, *value.shape), dtype)
            node[path[-1]][expert] = value
        del tensor
    return params


def read_config(model_dir: str | os.PathLike) -> DecoderConfig:
    """The DecoderConfig of a checkpoint's `config.json` (ValueError on what fnrl lacks)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"missing {config_path}")
    return DecoderConfig.from_hf(json.loads(config_path.read_text()))


def load_pretrained(model_dir: str | os.PathLike, *, dtype=jnp.float32,
                    param_dtype=jnp.float32, adapter_seed: int = 0, adapter_dtype=None,
                    **kernels) -> tuple[DecoderConfig, nnx.GraphDef, dict]:
    """Reads `config.json` and (possibly sharded) safetensors into (cfg, graphdef, params).

    `dtype`/`param_dtype` are the model's compute and storage dtypes (a bfloat16 file
    loads into float32 params or bfloat16 ones); `kernels` are the Decoder's remat,
    attention, attention_block, max_segments and lora. Params are numpy, read one tensor
    at a time, so peak memory is the params plus one tensor. With `lora` (rank > 0) they
    include fresh adapters (fnrl.models.lora.init_adapters from `adapter_seed`, in
    `adapter_dtype`, default `param_dtype`): the model is still exactly the checkpoint's.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    graphdef, _ = abstract_model(cfg, dtype=dtype, param_dtype=param_dtype, **kernels)
    params = hf_to_params(cfg, lazy_tensors(model_dir), dtype=param_dtype)
    lora = kernels.get("lora")
    if lora is not None and lora.enabled:
        adapters = init_adapters(cfg, lora, adapter_seed,
                                 dtype=_np_dtype(adapter_dtype or param_dtype))
        params = join(adapters, params)
    return cfg, graphdef, params


def read_generation_config(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint's `generation_config.json` as a dict (eos ids, sampling defaults),
    or None when it has none."""
    return read_json_if_present(Path(model_dir) / "generation_config.json")


def check_model_dir(model_dir: str | os.PathLike) -> None:
    """Checks that `model_dir` is a complete checkpoint fnrl can train and serve, before
    anything starts: FileNotFoundError naming a missing file (config.json, weights or a
    shard the index names, tokenizer.json), ValueError for a config fnrl cannot run or
    a weights file that lacks a tensor the config needs."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    cfg = read_config(model_dir)
    tensors = lazy_tensors(model_dir)  # FileNotFoundError names the missing weights
    missing = [name for name, *_ in _table(cfg) if name not in tensors]
    if missing:
        raise ValueError(f"{model_dir}: weights lack {len(missing)} tensor(s) config.json "
                         f"needs, e.g. {missing[:3]}")
    if not (model_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"{model_dir} lacks tokenizer.json")
    read_generation_config(model_dir)  # ValueError if present but unreadable


def _generation_config(cfg: DecoderConfig) -> dict:
    # Token ids only: vLLM adopts sampling defaults (top_k, temperature, ...) from this file,
    # which would silently change the RL sampling distribution.
    ids = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                            else cfg.eos_token_id)}
    return {k: v for k, v in ids.items() if v is not None}


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per shard, in table order; a shard closes before it would exceed
    `max_shard_bytes` (a single larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if max_shard_bytes is not None and shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _write_safetensors(path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: np.dtype,
                       tensors: Iterator[tuple[str, np.ndarray]]) -> None:
    """Streams one safetensors file: the header is known from the shapes alone, so each
    tensor is written as it comes and dropped (the library's save_file needs them all
    in memory at once). Layout: 8-byte little-endian header length, JSON header padded
    to 8 bytes, then the tensors' bytes in header order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers requires it
    offset = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype.name], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in shapes:
            got, tensor = next(tensors)
            if got != name or tensor.dtype != dtype or tensor.shape != tuple(shapes[name]):
                raise AssertionError(f"tensor {got} {tensor.shape} {tensor.dtype} out of order")
            # Raw bytes via a uint8 view: buffers do not export bfloat16 directly.
            f.write(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data)


def _write_weights(out: Path, cfg: DecoderConfig, params, dtype: np.dtype,
                   max_shard_bytes: int | None) -> None:
    if dtype.name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype={dtype.name}: not one of {sorted(_SAFETENSORS_DTYPES)}")
    table = _table(cfg)
    sizes = [(name, int(np.prod(shape)) * dtype.itemsize) for name, _, shape, *_ in table]
    shards = _plan_shards(sizes, max_shard_bytes)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shapes = {name: shape for name, _, shape, *_ in table}
    tensors = iter_hf_tensors(cfg, params, dtype=dtype)
    for file_name, shard in zip(names, shards):
        _write_safetensors(out / file_name, {n: shapes[n] for n in shard}, dtype, tensors)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def save_pretrained(model_dir: str | os.PathLike, cfg: DecoderConfig, params, *,
                    tokenizer_dir: str | os.PathLike | None = None, dtype=np.float32,
                    max_shard_bytes: int | None = None,
                    generation_config: Mapping[str, Any] | None = None) -> Path:
    """Writes an HF checkpoint directory (config, safetensors, generation config, tokenizer).

    `dtype`: of the tensors on disk ("bfloat16" or `jnp.bfloat16` for half the size).
    `max_shard_bytes`: split the weights into shards of at most this size (a larger
    single tensor gets its own) with a `model.safetensors.index.json`; None writes one
    `model.safetensors`. `generation_config`: written as given (e.g. the source model's),
    else token ids only. Tensors are converted and written one at a time.

    Written into a sibling temp dir and renamed into place, so readers never see a partial
    checkpoint; an existing `model_dir` is replaced.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be positive or None")
    model_dir = Path(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    dtype = _np_dtype(dtype)
    tmp = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=f".{model_dir.name}.tmp"))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype.name), indent=2))
        generation = dict(generation_config) if generation_config is not None else (
            _generation_config(cfg))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _write_weights(tmp, cfg, params, dtype, max_shard_bytes)
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
