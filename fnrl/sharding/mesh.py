"""Meshes with axes ("data", "fsdp", "tensor") and logical-axis rules per role.

Parameters carry logical axis names (vocab, embed, heads, ...); a rules table maps
each name to a mesh axis or to None (replicated). Meshes are passed as arguments. A mesh
axis shards at most one dimension of an array: when two of its logical axes map to the
same mesh axis (an expert kernel's "expert" and "embed" both to fsdp), the first that
the mesh axis divides takes it and the others stay whole.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")

# Trainer rules: FSDP shards the embedding dimension, tensor parallelism the heads and MLP.
TRAINER_RULES: Mapping[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    # Mixture-of-experts kernels (X×E×I) are split by whole experts over fsdp, so their
    # embed dimension stays whole (first claim wins, see `_claim_once`): FSDP's memory
    # saving without a new mesh axis, and each device holds a contiguous block of
    # experts, the layout an all-to-all expert-parallel dispatch would want later. The
    # experts' "mlp" still goes over tensor, as a dense MLP's does.
    "expert": "fsdp",
    "norm": None,
    "lora_rank": None,   # adapters are thin: their other axis is sharded as its kernel's
    "batch": ("data", "fsdp"),
}


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: every process's, `jax.devices()`); `data=-1` takes
    whatever fsdp*tensor leaves.

    With several trainer processes (fnrl.trainer.distributed) the devices are ordered by
    process, so the trailing axes (tensor, then fsdp) stay within a process and `data`
    spans processes: the slow link carries only the gradient reduction.
    """
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        if len(devices) % (fsdp * tensor):
            raise ValueError(f"fsdp*tensor={fsdp * tensor} does not divide {len(devices)} devices")
        data = len(devices) // (fsdp * tensor)
    if data * fsdp * tensor > len(devices):
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} needs more than {len(devices)} devices")
    used = devices[: data * fsdp * tensor]
    left_out = {d.process_index for d in devices} - {d.process_index for d in used}
    if left_out:
        # A process without a device in the mesh would hold no shard of the step.
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} leaves process(es) {sorted(left_out)} "
                         f"without devices: use all {len(devices)} devices")
    return jax.make_mesh((data, fsdp, tensor), AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=used)


def logical_to_mesh(spec: tuple | P | None, rules: Mapping[str, Any]) -> P:
    """Maps a tuple of logical names to a PartitionSpec of mesh axes."""
    if spec is None:
        return P()
    out = []
    for name in spec:
        if name is None:
            out.append(None)
        elif name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        else:
            out.append(rules[name])
    return P(*out)


def _divisible(spec: P, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """Drops a mesh axis from a dimension it does not divide (tiny models on big meshes)."""
    out = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axis,) if isinstance(axis, str) else (axis or ())
        size = 1
        for n in names:
            size *= mesh.shape[n]
        out.append(axis if dim % size == 0 else None)
    return P(*out)


def _claim_once(spec: P) -> P:
    """Each mesh axis on the first dimension that names it; later dimensions drop it
    (a PartitionSpec may use a mesh axis only once)."""
    claimed: set[str] = set()
    out = []
    for axis in spec:
        names = (axis,) if isinstance(axis, str) else tuple(axis or ())
        kept = tuple(n for n in names if n not in claimed)
        claimed.update(kept)
        out.append(kept[0] if len(kept) == 1 and isinstance(axis, str) else (kept or None))
    return P(*out)


def shardings_for(logical_tree: Any, shapes_tree: Any, mesh: jax.sharding.Mesh,
                  rules: Mapping[str, Any] = TRAINER_RULES) -> Any:
    """NamedShardings for a pytree, given its logical-axis tuples and its shapes."""
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, _claim_once(
            _divisible(logical_to_mesh(spec, rules), x.shape, mesh))),
        logical_tree, shapes_tree, is_leaf=lambda x: x is None or isinstance(x, (tuple, P)))


def partition_specs(logical_tree: Any, shapes_tree: Any, mesh: jax.sharding.Mesh,
                    rules: Mapping[str, Any] = TRAINER_RULES) -> dict[str, str]:
    """{"path/to/param": "PartitionSpec(...)"}: a flat, printable view for golden tests."""
    shardings = shardings_for(logical_tree, shapes_tree, mesh, rules)
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): str(sh.spec)
            for path, sh in flat}


def mesh_from_config(mesh_cfg, devices=None) -> jax.sharding.Mesh:
    """The mesh a `fnrl.config.MeshConfig` describes."""
    return make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, devices=devices)


def batch_sharding(mesh: jax.sharding.Mesh, rules: Mapping[str, Any] = TRAINER_RULES) -> NamedSharding:
    """Leading (batch) dimension over data and fsdp; the rest replicated."""
    return NamedSharding(mesh, P(rules["batch"]))


def global_arrays(host_tree: Any, shardings: Any) -> Any:
    """Host arrays (numpy) as global jax Arrays placed by `shardings` (a sharding or a
    pytree of them), on one process or several.

    Every process holds the same whole host tree (the simplest contract: each trainer
    process receives the full batch) and builds only the slices its own devices hold.
    With several processes a jitted step refuses numpy inputs for a sharded argument
    (measured, JAX 0.10.2), so the trainer's batch goes through here.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, host_tree)
    return jax.tree.map(
        lambda x, sharding: jax.make_array_from_callback(
            x.shape, sharding, lambda index: x[index]), host_tree, shardings)
