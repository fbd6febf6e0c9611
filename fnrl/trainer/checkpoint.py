"""Orbax checkpoints of the TrainState, and the log of batches trained since the last.

Cadence (`trainer.checkpoint_every` = k): the state is saved every k versions, and every
batch is logged (`BatchLog`, a few MB) before the step that trains it. A restarted
trainer restores the newest finished checkpoint and replays the logged batches after
it, in order, through the same jitted step: it comes back at the version it had, with
the same parameters (the step is deterministic), so the controller's assumption holds
whatever k is: a restarted trainer is at the version it answered last, or one past it
if it died inside a step (its batch was logged, so the step is replayed and taken as
done), and a job restart resumes every role from that version (fnrl.control.journal).
The price of k > 1 is replaying up to k - 1 steps at a restart; k = 1 replays nothing
(the default, the cheapest restart for small models).

Orbax writes into a temporary directory and renames it when complete, so a save that
is killed half way never hides the previous checkpoint: `latest_step` only sees
finished ones. A logged batch is written to a temporary file and renamed likewise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
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

    def all_steps(self) -> list[int]:
        """The finished checkpoints' steps, oldest first."""
        return sorted(self._manager.all_steps())

    def delete(self, step: int) -> None:
        """Removes checkpoint `step` (a rollback replaces a bad version's with a good one)."""
        self._manager.delete(step)

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


class BatchLog:
    """The batches trained since the newest checkpoint: DIR/<version>.npz holds the
    batch that trains version -> version + 1 (a skipped step's batch is overwritten
    by the next one sent for the same version)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, version: int) -> Path:
        return self.directory / f"{version}.npz"

    def write(self, version: int, batch: dict[str, np.ndarray]) -> None:
        """Logs `batch` as the one training `version`; visible whole or not at all."""
        tmp = self.directory / f".{version}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, **batch)
        os.replace(tmp, self._path(version))

    def versions(self) -> list[int]:
        return sorted(int(p.stem) for p in self.directory.glob("*.npz"))

    def read(self, version: int) -> dict[str, np.ndarray]:
        with np.load(self._path(version)) as z:
            return {k: z[k] for k in z.files}

    def prune(self, below: int) -> None:
        """Drops the batches of versions < `below` (a finished checkpoint holds them)."""
        for version in self.versions():
            if version < below:
                self._path(version).unlink(missing_ok=True)
