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

A finished checkpoint is known good once sealed: after the save, `seal` writes a
manifest of its files and sizes (`MANIFEST`). Storage can still damage it later (a
truncated file, a lost one), so a resume takes the newest checkpoint whose files match
its manifest and that Orbax restores (`restore_newest_good`), moves every one it skips to
`checkpoints_bad/<step>` with the reason, and says so. Checking sizes costs a `stat` per
file; a checksum of every byte would cost reading the state once more per save, which a
step's stall cannot afford at scale: damage that keeps a file's size is caught by
Orbax's own checks at restore, and then skipped the same way. The batch log keeps every
batch from the oldest kept checkpoint on, so rolling forward from any of them reaches
the version the trainer had.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fnrl.shell.files import remove_unfinished_saves

_SCAN_ATTEMPTS = 5
MANIFEST = "fnrl_manifest.json"
"""In a sealed checkpoint's directory: {"files": {relative path: size in bytes}}."""


class Checkpointer:
    """A thin owner of an Orbax CheckpointManager (lives only in the trainer process)."""

    def __init__(self, directory: Path, *, max_to_keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
        self._open()

    def _open(self) -> None:
        options = self._options
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
        try:
            self._manager.wait_until_finished()
        except BaseException:
            self._settle_failed_save()
            raise

    def _settle_failed_save(self) -> None:
        """After a save failed: waits for the rest of its writes. Orbax raises the first
        item's failure and leaves the other items' writes running (orbax-checkpoint 0.12,
        `_AsyncManager`): they would go on writing into the unfinished directory while
        the next save of that step, or `discard_unfinished`, removes it ("Directory not
        empty"). Orbax keeps those futures only privately: if a later Orbax moves them,
        this waits for nothing and the next save retries as before."""
        checkpointer = getattr(self._manager, "_checkpointer", None)
        manager = getattr(checkpointer, "_async_manager", None)
        for future in getattr(manager, "_commit_futures", None) or ():
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the save already failed; its first error is raised
                pass

    def discard_unfinished(self) -> list[str]:
        """Removes the temporary directories of saves that did not finish (a full disk
        fails a save half way) and rescans; returns their names."""
        names = remove_unfinished_saves(self.directory)
        self._rescan()
        return names

    def _rescan(self) -> None:
        """A new manager over the directory as it is now (it lists steps when made)."""
        try:
            self._manager.close()
        except Exception:  # noqa: BLE001 - a manager whose save failed may fail to close
            pass
        self._open()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def seal(self, step: int) -> None:
        """Records checkpoint `step`'s files and sizes (call after `wait`): from now on a
        resume can tell whether storage has damaged it."""
        root = self.step_dir(step)
        files = {str(p.relative_to(root)): p.stat().st_size
                 for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
        tmp = root / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"files": files}))
        os.replace(tmp, root / MANIFEST)

    def verify(self, step: int) -> str | None:
        """Why checkpoint `step` does not match its manifest (a file missing or of another
        size), or None (it matches, or it was never sealed: Orbax's checks decide)."""
        root = self.step_dir(step)
        try:
            files = json.loads((root / MANIFEST).read_text())["files"]
        except FileNotFoundError:
            return None
        except (ValueError, KeyError) as err:
            return f"its manifest is unreadable ({err})"
        for name, size in files.items():
            path = root / name
            if not path.exists():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} is {path.stat().st_size} bytes, {size} when it was saved"
        return None

    def restore_newest_good(self, target: Any) -> tuple[Any | None, int | None, list]:
        """(state, its step, [(skipped step, reason), ...]): the newest checkpoint that
        matches its manifest and restores. Each one skipped is moved to
        `checkpoints_bad/<step>` beside the checkpoints, with its reason in `reason.txt`.
        (None, None, skipped) when no checkpoint is good."""
        skipped = []
        for step in reversed(self.all_steps()):
            reason = self.verify(step)
            if reason is None:
                try:
                    return self.restore(target, step)[0], step, skipped
                except Exception as err:  # noqa: BLE001 - Orbax's many kinds of "damaged"
                    reason = f"Orbax could not restore it: {type(err).__name__}: " + (
                        str(err).strip().splitlines() or [""])[0][:300]
            skipped.append((step, reason))
            self._quarantine(step, reason)
        return None, None, skipped

    def _quarantine(self, step: int, reason: str) -> None:
        """Moves a damaged checkpoint out of the manager's sight, with why."""
        bad = self.directory.parent / "checkpoints_bad" / str(step)
        bad.parent.mkdir(parents=True, exist_ok=True)
        try:
            if bad.exists():
                shutil.rmtree(bad)
            os.replace(self.step_dir(step), bad)
            (bad / "reason.txt").write_text(reason + "\n")
        except FileNotFoundError:
            pass   # another process of a trainer group moved it first
        self._rescan()

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
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **batch)
        except BaseException:
            tmp.unlink(missing_ok=True)   # a full disk leaves no half-written batch behind
            raise
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
