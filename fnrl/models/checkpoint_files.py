"""The files of a Hugging Face checkpoint and of a PEFT adapter, without JAX: vLLM's
worker process (fnrl.serving.worker_ext) reads the base weights an adapter merges into
through this module, and must not import JAX to do it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

SCALING_TENSOR = "fnrl.lora_scaling"
"""A published adapter version carries its alpha / r as this 1-element float32 tensor, so
a rollout merging it needs nothing but the version."""

_PEFT_PREFIX, _A, _B = "base_model.model.", ".lora_A.weight", ".lora_B.weight"


def peft_names(hf_module: str) -> tuple[str, str]:
    """PEFT's names of the A and B of the adapter on `hf_module`
    ("model.layers.3.self_attn.q_proj")."""
    return _PEFT_PREFIX + hf_module + _A, _PEFT_PREFIX + hf_module + _B


def adapted_modules(names) -> list[str]:
    """The HF modules ("model.layers.3.mlp.up_proj") that tensors `names` adapt, in order."""
    return [n[len(_PEFT_PREFIX):-len(_A)] for n in names
            if n.startswith(_PEFT_PREFIX) and n.endswith(_A)]


def _read_index(model_dir: Path) -> dict[str, str]:
    """weight_map of the index file: tensor name -> shard file name."""
    index_path = model_dir / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path} is not a safetensors index with a weight_map: {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: weight_map is empty or not an object")
    return weight_map


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else
    `model.safetensors`. Raises FileNotFoundError naming a missing one."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).exists():
        files = [model_dir / f for f in sorted(set(_read_index(model_dir).values()))]
    elif (model_dir / SINGLE_FILE).exists():
        files = [model_dir / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{model_dir}: {INDEX_FILE} names missing shard(s) {missing}")
    return files


class LazyTensors(Mapping):
    """A checkpoint's tensors by name, each read from its file when looked up (numpy
    arrays, or torch tensors with framework="pt")."""

    def __init__(self, files_by_name: Mapping[str, Path], framework: str = "numpy"):
        self._files, self._framework = dict(files_by_name), framework

    def __getitem__(self, name: str):
        if name not in self._files:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        with safe_open(self._files[name], framework=self._framework) as f:
            return f.get_tensor(name)

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._files

    def __iter__(self):
        return iter(self._files)

    def __len__(self):
        return len(self._files)


def lazy_tensors(model_dir: str | os.PathLike, framework: str = "numpy") -> LazyTensors:
    """Every tensor of `model_dir`'s safetensors files (`weight_files`), read lazily."""
    files_by_name = {}
    for path in weight_files(model_dir):
        with safe_open(path, framework=framework) as f:
            files_by_name.update((name, path) for name in f.keys())
    return LazyTensors(files_by_name, framework)
