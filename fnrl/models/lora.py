"""LoRA adapters on the decoder's projections: their leaves in the params tree, the
frozen/trainable split, merging, and the PEFT layout they are published and exported in.

With `LoraConfig.rank` > 0 the Decoder gives each targeted projection two more params,
`<x>_lora_a` (in × r) and `<x>_lora_b` (r × out) beside `<x>_kernel`, and computes

    y = x·W + (alpha / r) · (x·A)·B

The adapter runs beside the frozen kernel rather than being merged into it inside the
step: the step then never forms a weight-sized W + s·A·B, and autodiff, asked only for
the adapters' gradient, never forms a weight-sized gradient either (x·A is tokens × r).
That is where LoRA's memory saving in a train step comes from, beside the optimizer's
moments for the adapters alone.

A trainer holds the adapters as its `TrainState.params` and the rest as a frozen tree;
`join` puts them back together for the forward pass. A version is published as the
adapters alone, in PEFT's names and layout (`peft_tensors`), which is also what the
export writes next to a merged model (`merge`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fnrl.config.lora import LORA_TARGETS, LoraConfig
from fnrl.models.checkpoint_files import SCALING_TENSOR, peft_names
from fnrl.models.families import DecoderConfig

__all__ = ["LORA_TARGETS", "SCALING_TENSOR", "adapter_leaves", "delta_change_norm",
           "init_adapters", "is_adapter", "join", "lora_delta", "merge", "peft_config",
           "peft_tensors", "split_adapters"]

_A, _B = "_lora_a", "_lora_b"

# Target name -> (module in a layer's params, the kernel's name prefix, HF module path).
_WHERE = {"q_proj": ("attn", "q", "self_attn.q_proj"), "k_proj": ("attn", "k", "self_attn.k_proj"),
          "v_proj": ("attn", "v", "self_attn.v_proj"), "o_proj": ("attn", "o", "self_attn.o_proj"),
          "gate_proj": ("mlp", "gate", "mlp.gate_proj"), "up_proj": ("mlp", "up", "mlp.up_proj"),
          "down_proj": ("mlp", "down", "mlp.down_proj")}


def is_adapter(key: str) -> bool:
    return key.endswith(_A) or key.endswith(_B)


def lora_delta(x_NxI, a, b, scaling: float):
    """(alpha / r)·(x·A)·B for N tokens of in-width I: A is I... × r and B r × ...out,
    flattened to 2-D here (heads and head_dim kept apart in the params, as the kernels)."""
    rank = a.shape[-1]
    a_Ixr = a[...].reshape(-1, rank).astype(x_NxI.dtype)
    b_rxO = b[...].reshape(rank, -1).astype(x_NxI.dtype)
    return ((x_NxI @ a_Ixr) @ b_rxO) * jnp.asarray(scaling, x_NxI.dtype)


def delta_change_norm(old: Mapping, new: Mapping, scaling: float):
    """‖ΔW‖ over every adapted projection, W = s·A·B, from adapters `old` to `new`: how
    far an update moves the model's weights (what `update_ratio` bounds), not the
    adapters'. Exact without forming any in × out product: with A_c = [A', -A] and
    B_c = [B'; B], ‖A'B' - AB‖² = tr((A_cᵀA_c)(B_c B_cᵀ)), two 2r × 2r Gram matrices."""
    total = jnp.zeros((), jnp.float32)
    for key, value in new.items():
        if isinstance(value, Mapping):
            total = total + delta_change_norm(old[key], value, scaling) ** 2
        elif str(key).endswith(_A):
            b_key = str(key)[: -len(_A)] + _B
            rank = value.shape[-1]
            flat = lambda x: x.reshape(-1, rank).astype(jnp.float32)  # noqa: E731
            a_c = jnp.concatenate([flat(value), -flat(old[key])], axis=1)
            b_c = jnp.concatenate([new[b_key].reshape(rank, -1), old[b_key].reshape(rank, -1)],
                                  axis=0).astype(jnp.float32)
            total = total + scaling**2 * jnp.maximum(jnp.sum((a_c.T @ a_c) * (b_c @ b_c.T)), 0.0)
    return jnp.sqrt(total)


def split_adapters(params: Mapping) -> tuple[dict, dict]:
    """(adapters, frozen): the params tree in two, each keeping only its own leaves."""
    adapters, frozen = {}, {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            a, f = split_adapters(value)
            if a:
                adapters[key] = a
            if f:
                frozen[key] = f
        elif is_adapter(str(key)):
            adapters[key] = value
        else:
            frozen[key] = value
    return adapters, frozen


def join(adapters: Mapping, frozen: Mapping) -> dict:
    """The whole params tree from its two halves (`split_adapters` undone)."""
    out = dict(frozen)
    for key, value in adapters.items():
        out[key] = join(value, frozen.get(key, {})) if isinstance(value, Mapping) else value
    return out


def adapter_leaves(cfg: DecoderConfig, lora: LoraConfig) -> dict[tuple, tuple[tuple, tuple]]:
    """{path of `<x>_lora_a` in params: (A's shape, B's shape)} for every layer and target,
    in the layout the Decoder gives them (in-dims × r, r × out-dims)."""
    E, I, r = cfg.hidden_size, cfg.intermediate_size, lora.rank
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"q_proj": ((E,), (H, D)), "k_proj": ((E,), (K, D)), "v_proj": ((E,), (K, D)),
              "o_proj": ((H, D), (E,)), "gate_proj": ((E,), (I,)), "up_proj": ((E,), (I,)),
              "down_proj": ((I,), (E,))}
    out = {}
    for i in range(cfg.num_hidden_layers):
        for target in lora.targets:
            module, prefix, _ = _WHERE[target]
            ins, outs = shapes[target]
            out[("layers", i, module, prefix + _A)] = ((*ins, r), (r, *outs))
    return out


def adapter_a_init(key, shape, dtype=jnp.float32):
    """PEFT's A: Kaiming-uniform with a = sqrt(5), i.e. U(±1/sqrt(fan_in)) over the
    input dims (every dim but the rank)."""
    bound = 1.0 / np.sqrt(float(np.prod(shape[:-1])))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def init_adapters(cfg: DecoderConfig, lora: LoraConfig, seed: int, dtype=np.float32) -> dict:
    """Fresh adapters as a params subtree of numpy arrays: A random (one key per leaf,
    from `seed` and its path, so a rebuild gives the same), B zero, so the model with
    them is exactly the base."""
    tree: dict = {}
    root = jax.random.key(seed)
    for n, (path, (a_shape, b_shape)) in enumerate(adapter_leaves(cfg, lora).items()):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        a = adapter_a_init(jax.random.fold_in(root, n), a_shape)
        node[path[-1]] = np.asarray(a).astype(dtype)
        node[path[-1][: -len(_A)] + _B] = np.zeros(b_shape, dtype)
    return tree


def _leaf(tree: Mapping, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def merge(params: Mapping, lora: LoraConfig) -> dict:
    """The params without adapters, each targeted kernel replaced by W + s·A·B (computed
    in float32, stored in the kernel's dtype): a plain model for export or serving.
    Numpy in and out; a tree without adapters comes back as its frozen half."""
    adapters, frozen = split_adapters(params)
    if not adapters:
        return frozen
    out = jax.tree.map(lambda x: x, frozen)   # a new tree; the leaves are not copied
    for i in range(len(frozen["layers"])):
        for target in lora.targets:
            module, prefix, _ = _WHERE[target]
            a = np.asarray(adapters["layers"][i][module][prefix + _A], np.float32)
            b = np.asarray(adapters["layers"][i][module][prefix + _B], np.float32)
            w = np.asarray(frozen["layers"][i][module][prefix + "_kernel"])
            delta = (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)) * lora.scaling
            out["layers"][i][module][prefix + "_kernel"] = (
                w.astype(np.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return out


def peft_tensors(cfg: DecoderConfig, lora: LoraConfig, adapters: Mapping, *,
                 dtype=np.float32, scaling: bool = True) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names and layout (`lora_A.weight` r × in,
    `lora_B.weight` out × r, in HF's flattening of heads), contiguous, in `dtype`; with
    `scaling`, also `SCALING_TENSOR` (a published version; not in an exported adapter,
    whose adapter_config.json says it)."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        for target in lora.targets:
            module, prefix, hf_module = _WHERE[target]
            node = adapters["layers"][i][module]
            a, b = np.asarray(node[prefix + _A]), np.asarray(node[prefix + _B])
            a_name, b_name = peft_names(f"model.layers.{i}.{hf_module}")
            out[a_name] = np.ascontiguousarray(a.reshape(-1, lora.rank).T, dtype=dtype)
            out[b_name] = np.ascontiguousarray(b.reshape(lora.rank, -1).T, dtype=dtype)
    if scaling:
        out[SCALING_TENSOR] = np.asarray([lora.scaling], np.float32)
    return out


def peft_config(lora: LoraConfig, base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for these adapters (vLLM and PEFT load it)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(lora.targets), "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True}
