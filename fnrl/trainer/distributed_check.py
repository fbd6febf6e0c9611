"""A trainer group's pre-flight check: run it in every trainer process of a new cluster
(by hand, under srun, or in each pod) before a job, and the tests run it on loopback.

    python -m fnrl.trainer.distributed_check --out DIR [--distributed.num-processes 0 ...]

Each process joins the group (fnrl.trainer.distributed), then:
  - reduce_scatter: a sum over every device of the group, each device keeping its shard,
    on float32 tensors of `reduce_scatter_mib` MiB per output shard, of whole numbers, so
    any summation order gives the exact result; each process writes its devices' output
    shards. It is compiled as the train step's gradient reduction is (see
    `scatter_sum`), and the check refuses to run a program holding XLA:CPU's native
    reduce-scatter.
  - step: the real jitted train step (fnrl.trainer.step) of a tiny decoder on a fixed
    batch over the global mesh, `steps` times; every process writes the whole params.
  - checkpoint: the state after the steps is saved with fnrl.trainer.checkpoint in every
    process and restored in every process onto the mesh's shardings; each process writes
    whether the restore equals the saved state bit for bit, and the restored params.
  - restore_from: a checkpoint directory another group saved (any process count) is
    restored onto this group's mesh and written as restored_params.

Outputs are DIR/<check>_<process_id>.npz (whole host arrays), read by
tests/trainer/test_distributed.py, which compares them with numpy and with one process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

# JAX is imported inside the functions: the group is joined before JAX starts its backend.
import numpy as np
import tyro

from fnrl.config.distributed import DistributedConfig
from fnrl.trainer.distributed import join, leave

CHECKS = ("reduce_scatter", "step", "checkpoint")

# The tiny decoder of tests/losses/test_terms_in_step.py (fsdp=2 divides its widths).
TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckArgs:
    """What to check and where to write it."""
    out: str
    checks: tuple[str, ...] = CHECKS
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    data: int = -1
    """The mesh's data axis (-1: the devices fsdp leaves), across processes."""
    fsdp: int = 2
    steps: int = 2
    reduce_scatter_mib: tuple[float, ...] = (4.0, 12.0, 3.000011444091797)
    """Output shard sizes; the last is 3 MiB + 12 bytes (not a power of two)."""
    restore_from: str = ""

    def __post_init__(self):
        unknown = sorted(set(self.checks) - set(CHECKS))
        if unknown:
            raise ValueError(f"unknown check(s) {unknown}; known: {CHECKS}")


def scatter_input(mib: float, device: int, devices: int):
    """Device `device`'s input to the reduce-scatter: whole numbers in [-1000, 1000] as
    float32, `devices` output shards of `mib` MiB each (a pure function of its
    arguments, so the test builds the same)."""
    per_shard = int(mib * 2**20) // 4
    rng = np.random.default_rng([int(mib * 2**20), device])
    return rng.integers(-1000, 1001, per_shard * devices).astype(np.float32)


def toy_batch(rows: int = 8):
    """A fixed batch for the tiny decoder (the same in every process)."""
    from fnrl.trainer.step import pack_sequences, scatter_response

    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(3, 16, 5)) for _ in range(rows)]
    responses = [tuple(int(t) for t in rng.integers(3, 16, 4)) for _ in range(rows)]
    batch = pack_sequences(prompts, responses, 16, pad_id=0)
    batch["behaviour_logp_BxT"] = scatter_response([(-3.0,) * 4] * rows, [5] * rows, 16)
    batch["adv_B"] = rng.standard_normal(rows).astype(np.float32)
    return batch


def _host(tree):
    """Whole host copies of (possibly cross-process) arrays, in every process."""
    import jax
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def _flat(tree, prefix: str) -> dict:
    import jax

    return {prefix + "/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


# XLA:CPU's native reduce-scatter runs gloo's halving-doubling algorithm, which can
# return wrong values at the end of rank 0's shard for shards of a few MiB, with no error
# (jax-ml/jax#40830; seen once in this check's CI run, on a 12 MiB shard of rank 0).
# The SPMD partitioner does not emit it on CPU: fnrl's train step reduces its FSDP
# gradients with all-reduce and keeps its slice (tests/trainer/test_distributed.py
# checks the compiled step). The check reduces the same way, so it checks what a CPU
# trainer group runs; on GPU the native op is NCCL's and is the one checked.
NATIVE_REDUCE_SCATTER = " reduce-scatter("


def scatter_sum(mesh, axis: str, platform: str):
    """f(x) over `mesh`: the sum over `axis` of every device's x, each device keeping its
    own 1/n slice (a tiled psum_scatter), as all-reduce + slice on CPU."""
    import jax
    from jax.sharding import PartitionSpec as P

    def native(x):
        return jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)

    def all_reduce_then_slice(x):
        n = x.shape[0] // jax.lax.axis_size(axis)
        return jax.lax.dynamic_slice_in_dim(jax.lax.psum(x, axis),
                                            jax.lax.axis_index(axis) * n, n)

    body = all_reduce_then_slice if platform == "cpu" else native
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def check_reduce_scatter(args: CheckArgs, out: Path, rank: int) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    sharding = NamedSharding(mesh, P("x"))
    platform = devices[0].platform
    scatter = scatter_sum(mesh, "x", platform)
    written = {}
    for mib in args.reduce_scatter_mib:
        n = scatter_input(mib, 0, len(devices)).size
        # Device d's slice of the global input is its own scatter_input (built lazily:
        # each process makes only its devices' parts).
        global_in = jax.make_array_from_callback(
            (n * len(devices),), sharding,
            lambda index: scatter_input(mib, index[0].start // n, len(devices)))
        compiled = scatter.lower(global_in).compile()    # once: checked, then run
        if platform == "cpu" and NATIVE_REDUCE_SCATTER in compiled.as_text():
            raise RuntimeError("XLA compiled the CPU scatter_sum to a native "
                               "reduce-scatter, which jax-ml/jax#40830 makes unsafe")
        result = compiled(global_in)
        for shard in result.addressable_shards:
            written[f"{mib}/{shard.index[0].start // (n // len(devices))}"] = np.asarray(
                shard.data)
        del global_in, result
    np.savez(out / f"reduce_scatter_{rank}.npz", **written)


def _tiny_trainer(args: CheckArgs):
    """The tiny model's compiled step, its initial sharded state and the state's
    shardings, over a data x fsdp mesh of the global devices."""
    import jax

    from fnrl.config import AlgoConfig
    from fnrl.models.decoder import DecoderConfig, init_model, logical_axes
    from fnrl.sharding.mesh import batch_sharding, make_mesh, shardings_for
    from fnrl.trainer.step import (compile_train_step, init_sharded_state, make_optimizer,
                                   place_params, state_shardings)

    cfg = DecoderConfig(**TINY)
    graphdef, params = init_model(cfg, seed=0)
    host_params = jax.device_get(params)
    mesh = make_mesh(data=args.data, fsdp=args.fsdp)
    param_sh = shardings_for(logical_axes(cfg), host_params, mesh)
    algo = AlgoConfig(learning_rate=1e-2)
    optimizer = make_optimizer(algo)
    state_sh = state_shardings(optimizer, host_params, param_sh)
    state = init_sharded_state(place_params(host_params, param_sh), optimizer, state_sh)
    step = compile_train_step(graphdef, optimizer, algo, state_sh, batch_sharding(mesh))
    return step, state, state_sh, mesh


def check_step(args: CheckArgs, out: Path, rank: int, checks: tuple[str, ...]) -> None:
    import jax

    from fnrl.sharding.mesh import batch_sharding, global_arrays
    from fnrl.trainer.checkpoint import Checkpointer

    step, state, state_sh, mesh = _tiny_trainer(args)
    if args.restore_from:
        restored, _ = Checkpointer(Path(args.restore_from), async_save=False).restore(state)
        np.savez(out / f"restored_params_{rank}.npz", **_flat(_host(restored.params), ""))
    if "step" not in checks and "checkpoint" not in checks:
        return
    # Two rows per device (8 on the tests' 4 devices): the batch splits over them all.
    batch = global_arrays(toy_batch(max(8, 2 * jax.device_count())), batch_sharding(mesh))
    initial = _flat(_host(state.params), "init/")     # before the step donates the state
    losses = []
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        losses.append(float(_host(metrics["loss"])))
    np.savez(out / f"step_{rank}.npz", losses=np.array(losses),
             step=np.asarray(_host(state.step)), **initial,
             **_flat(_host(state.params), "params/"))
    if "checkpoint" in checks:
        checkpoints = Checkpointer(out / "checkpoints")
        checkpoints.save(int(_host(state.step)), state, {"losses": losses})
        checkpoints.wait()
        restored, extra = checkpoints.restore(jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_sh))
        checkpoints.close()
        # Bit for bit, shard by shard, on this process's devices.
        same = all(
            a.index == b.index and np.array_equal(np.asarray(a.data), np.asarray(b.data))
            and a.data.dtype == b.data.dtype
            for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored))
            for a, b in zip(x.addressable_shards, y.addressable_shards))
        np.savez(out / f"checkpoint_{rank}.npz", same=np.array(same),
                 extra_losses=np.array(extra["losses"]),
                 **_flat(_host(restored.params), "params/"))


def main(args: CheckArgs) -> None:
    import jax

    group = join(args.distributed)
    rank = 0 if group is None else group.process_id
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if "reduce_scatter" in args.checks:
            check_reduce_scatter(args, out, rank)
        if "step" in args.checks or "checkpoint" in args.checks or args.restore_from:
            check_step(args, out, rank, args.checks)
        (out / f"done_{rank}").write_text(f"{jax.process_count()} {jax.device_count()}\n")
    finally:
        if group is not None:
            leave()


if __name__ == "__main__":
    main(tyro.cli(CheckArgs))
