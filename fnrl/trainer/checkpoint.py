"""Orbax checkpoints of the TrainState, saved every step, asynchronously.

Orbax writes into a temporary directory and renames it when complete, so a save that
is killed half way never hides the previous checkpoint: `latest_step` only sees
finished ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """A thin owner of an Orbax CheckpointManager (lives only in the trainer process)."""

    def __init__(self, directory: Path, *, max_to_keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, extra: dict | None = None) -> None:
        """Starts an async save; returns once device buffers are copied (not written)."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra or {})))

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores onto the structure, dtypes and shardings of `target` (abstract is fine)."""
        step = self._manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()))
        return restored["state"], dict(restored.get("extra") or {})

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
