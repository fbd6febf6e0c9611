"""Orbax checkpoints of the TrainState, saved every step, asynchronously.

Orbax writes into a temporary directory and renames it when complete, so a save that
is killed half way never hides the previous checkpoint: `latest_step` only sees
finished ones.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


_SCAN_ATTEMPTS = 5


class Checkpointer:
    """A thin owner of an Orbax CheckpointManager (lives only in the trainer process)."""

    def __init__(self, directory: Path, *, max_to_keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
        # The manager scans the steps on creation. A warm standby scans while the live
        # trainer commits a step and deletes the oldest: a step can vanish mid-scan
        # (Orbax then fails on its missing metadata). Scan again: the race is short.
        for attempt in range(_SCAN_ATTEMPTS):
            try:
                self._manager = ocp.CheckpointManager(self.directory, options=options)
                break
            except Exception:  # noqa: BLE001 - Orbax raises several kinds here
                if attempt == _SCAN_ATTEMPTS - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))

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
