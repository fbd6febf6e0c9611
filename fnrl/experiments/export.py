"""A run's trained model out of its checkpoints: a Hugging Face model directory, and with
LoRA also a PEFT adapter directory.

    python -m fnrl.experiments.export RUN_DIR [--version V] [--out DIR] [--dtype bfloat16]

Writes OUT/model (config.json, safetensors, generation_config.json and the tokenizer
files of the model the run started from: transformers and vLLM load it as it is) for
version V (default: the newest checkpoint). With LoRA (`--trainer.lora.rank` > 0) the
model is the base with the adapters merged in (W + alpha/r · A·B), and OUT/adapter holds
the adapters alone (adapter_config.json + adapter_model.safetensors, PEFT's format:
`PeftModel.from_pretrained(base, OUT/adapter)`, or vLLM's `--enable-lora`).
OUT defaults to RUN_DIR/export/vV.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from fnrl.config import RunConfig, load_json

__all__ = ["export", "restored_params"]


def restored_params(cfg: RunConfig, model_dir: Path, run_dir: Path,
                    versions: list[int]) -> Iterator[tuple[int, dict]]:
    """Yields (version, host params) for each version in `versions` that can be restored:
    version 0 from the model directory, the others from the run's Orbax checkpoints,
    restored onto a state built as the trainer builds it. With LoRA the params are the
    whole tree, adapters included (fnrl.models.lora.merge makes them a plain model)."""
    import jax
    import jax.numpy as jnp

    from fnrl.models.decoder import logical_axes
    from fnrl.models.hf_io import load_pretrained
    from fnrl.models.lora import join, split_adapters
    from fnrl.sharding.mesh import mesh_from_config, shardings_for
    from fnrl.trainer.checkpoint import Checkpointer
    from fnrl.trainer.step import (init_sharded_state, initial_critic, make_optimizer,
                                   place_params, state_shardings)

    tc = cfg.trainer
    lora = tc.lora if tc.lora.enabled else None
    # Only the parameters are used (no forward pass): compute dtype and kernels do not matter.
    model_cfg, _, host_params = load_pretrained(
        model_dir, param_dtype=jnp.dtype(tc.param_dtype), adapter_seed=cfg.seed, lora=lora)
    mesh = mesh_from_config(tc.mesh)
    param_sh = shardings_for(logical_axes(model_cfg, lora), host_params, mesh)
    base = {}
    if lora is not None:   # the checkpoints hold the adapters' state; the base is the model's
        (host_params, base), (param_sh, _) = split_adapters(host_params), split_adapters(param_sh)
    optimizer = make_optimizer(cfg.algo, total_steps=cfg.steps)
    # Shardings first: place_params consumes the host copy.
    critic = initial_critic(cfg.algo, model_cfg.hidden_size)   # the checkpoints hold it too
    state_sh = state_shardings(optimizer, host_params, param_sh, critic)
    state = init_sharded_state(place_params(host_params, param_sh), optimizer, state_sh, critic)
    # Opened to read: a max_to_keep above any run's count, so nothing is ever pruned.
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=1 << 30, async_save=False)
    saved = set(ckpt.all_steps())
    try:
        for version in versions:
            if version == 0:
                params = state.params
            elif version in saved:
                params = ckpt.restore(state, step=version)[0].params
            else:
                print(f"version {version}: no checkpoint (kept: {sorted(saved)}); skipped",
                      flush=True)
                continue
            yield version, join(jax.device_get(params), base)
    finally:
        ckpt.close()


def export(run_dir: Path, out: Path | None = None, version: int | None = None,
           dtype: str = "float32") -> Path:
    """Writes the run's model at `version` (default: its newest checkpoint) to OUT/model,
    and with LoRA its adapters to OUT/adapter; returns OUT."""
    import numpy as np
    from safetensors.numpy import save_file

    from fnrl.experiments.math_grpo import resolve_model_dir
    from fnrl.models.hf_io import read_config, read_generation_config, save_pretrained
    from fnrl.models.lora import merge, peft_config, peft_tensors, split_adapters
    from fnrl.trainer.checkpoint import Checkpointer

    run_dir = run_dir.absolute()
    cfg = load_json(RunConfig, run_dir / "config.json")
    model_dir = resolve_model_dir(cfg)
    if version is None:
        ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=1 << 30, async_save=False)
        version = ckpt.latest_step() or 0
        ckpt.close()
    out = (out or run_dir / "export" / f"v{version}").absolute()
    restored = dict(restored_params(cfg, model_dir, run_dir, [version]))
    if version not in restored:
        raise FileNotFoundError(f"{run_dir}: no checkpoint of version {version}")
    params, lora = restored[version], cfg.trainer.lora
    model_cfg = read_config(model_dir)
    save_pretrained(out / "model", model_cfg, merge(params, lora), tokenizer_dir=model_dir,
                    dtype=dtype, generation_config=read_generation_config(model_dir))
    if lora.enabled:
        adapter = out / "adapter"
        adapter.mkdir(parents=True, exist_ok=True)
        tensors = peft_tensors(model_cfg, lora, split_adapters(params)[0], dtype=np.float32,
                               scaling=False)
        save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
        (adapter / "adapter_config.json").write_text(
            json.dumps(peft_config(lora, str(model_dir)), indent=2))
    (out / "export.json").write_text(json.dumps(
        {"run_dir": str(run_dir), "version": version, "base_model": str(model_dir),
         "lora": lora.enabled and {"rank": lora.rank, "alpha": lora.alpha,
                                   "targets": list(lora.targets)}}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--version", type=int, default=None,
                        help="the version to export (default: the newest checkpoint)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out, args.version, args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"fnrl.experiments.export: {err}", file=sys.stderr)
        return 2
    print(f"exported {out / 'model'}" + (f" and {out / 'adapter'}"
                                         if (out / "adapter").exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
