"""The controller's journal: what a restarted controller needs to lose nothing.

An append-only JSON-lines file in the run directory, written before the action it
records takes effect:
  fill     a group entered the job: its problem, member uids and forced lengths
           (the prompt cursor is the number of fill records);
  drop     groups discarded for good (aborted, or uninformative under DAPO sampling);
  consume  a batch is sent to the trainer to train version → version + 1;
  trained  the trainer returned that step;
  discard  a restarted controller dropped streamed tokens too stale for the bound.
Together with the partial response pool (every streamed token and log-prob) and the
trainer's newest checkpoint, `replay` rebuilds the controller's state: which groups
are outstanding, which were consumed, and how far the prompt stream had gone. A
`consume` without `trained` was applied exactly when the restored trainer's version is
past it (the trainer checkpoints a step before it answers), so no batch is trained
twice or lost.

Exactly-once is defined against this file, so its records are framed with a checksum
(fnrl.shell.records): a torn last record (a crash mid-write: the action it recorded never
happened) is dropped and cut off before the journal is appended to again; a damaged
record in the middle raises `DamagedRecord` naming the file and byte offset, before any
role starts (`check`). It is never cut there: the records after it are the only memory
of groups already trained, and replaying without them would train those groups again.
One writer (the controller) appends; with `fsync_logs` every record is fsynced
before the action it records, else the OS flushes it (a crash of the controller loses
nothing written; a crash of the machine may cut the tail, which a resume then reads as
torn).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fnrl.shell import records as framed


@dataclass(frozen=True)
class FilledGroup:
    problem: dict            # the Problem's fields
    uids: tuple[str, ...]
    target_lens: tuple[int | None, ...]


@dataclass(frozen=True)
class Replayed:
    groups: tuple[FilledGroup, ...] = ()                # in fill order
    consumed: frozenset[str] = frozenset()              # problem uids of trained groups
    dropped: frozenset[str] = frozenset()
    unlogged: tuple[tuple[int, tuple[str, ...]], ...] = ()
    trained_steps: int = 0                              # train steps done, skipped ones too
    """(version, problem uids) of batches the trainer applied but whose return the
    controller never saw: their consumption must still be logged."""
    gate_lr_scale: float = 1.0          # the correctness gates' last learning-rate scale
    gate_rollbacks: int = 0             # ...and their rollbacks so far (fnrl.control.gating)

    @property
    def prompts_taken(self) -> int:
        return len(self.groups)

    def outstanding(self) -> list[FilledGroup]:
        done = self.consumed | self.dropped
        return [g for g in self.groups if g.problem["uid"] not in done]


def records(path: Path) -> list[dict]:
    """The journal's records, a torn tail dropped ([] without a journal); raises
    `fnrl.shell.records.DamagedRecord` for damage in the middle."""
    return framed.read(path).records


def check(path: Path) -> None:
    """Raises `DamagedRecord` (a ValueError) if the journal is damaged in the middle,
    saying what the run's owner can do: called before any role starts."""
    try:
        framed.read(path)
    except framed.DamagedRecord as err:
        run_dir = path.parent
        raise err.advised(
            "Resuming would train the groups recorded after it a second time, so the run "
            f"does not start. To go on: put back a copy of {path.name} if there is one; or "
            f"start a new run from this one's newest checkpoint (python -m "
            f"fnrl.experiments.export {run_dir}, then --model.model-dir "
            f"{run_dir}/export/vN/model with a new --run-dir), which keeps the weights but "
            "not the optimizer's moments or the position in the prompt stream") from None


def replay(path: Path, *, trainer_version: int) -> Replayed:
    """The journal's state, given the version the trainer restored."""
    if not path.exists():
        return Replayed()
    groups: list[FilledGroup] = []
    consumed: set[str] = set()
    dropped: set[str] = set()
    pending: dict[int, tuple[str, ...]] = {}
    trained = 0
    lr_scale, rollbacks = 1.0, 0
    for r in framed.read(path).records:
        ev = r["ev"]
        if ev == "gate":
            lr_scale, rollbacks = r["lr_scale"], r["rollbacks"]
        if ev == "fill":
            groups.append(FilledGroup(r["problem"], tuple(r["uids"]), tuple(r["lens"])))
        elif ev == "drop":
            dropped.update(r["groups"])
        elif ev == "consume":
            pending[r["version"]] = tuple(r["groups"])
        elif ev == "trained":
            consumed.update(pending.pop(r["version"], ()))
            trained += 1
    unlogged = []
    for version, names in sorted(pending.items()):
        if version < trainer_version:   # the restored checkpoint holds this step
            consumed.update(names)
            unlogged.append((version, names))
    return Replayed(tuple(groups), frozenset(consumed), frozenset(dropped), tuple(unlogged),
                    trained + len(unlogged), gate_lr_scale=lr_scale, gate_rollbacks=rollbacks)


@dataclass
class Journal:
    path: Path
    fsync: bool = False
    _f: object = field(init=False, default=None)

    def __post_init__(self):
        # Damage refuses (DamagedRecord); a torn tail is cut before appending
        # (framed.append): a record written after it would fuse with the fragment.
        framed.read(self.path)
        self._f = framed.append(self.path)

    def write(self, ev: str, **fields) -> None:
        self._f.write(framed.frame({"ev": ev, **fields}))
        if self.fsync:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
