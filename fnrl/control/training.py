"""The trainer side of `act`: a Consume takes exactly the named groups from the table,
checks the staleness bound on every token, builds the batch and trains it as a task.

A step the trainer skips (a non-finite loss or gradient: parameters and optimizer state
kept bit for bit) still consumes its groups; the trainer's version does not advance,
and the next snapshot tells the schedule so (`skipped_steps`), which moves its buffers
one version down, so the run goes on at the same version.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

import numpy as np

from fnrl.config import RunConfig
from fnrl.control.book import Book, Services, TaskIO
from fnrl.control.handles import RoleError, TrainerHandle, TrainResult
from fnrl.control.recovery import ConsumedLog
from fnrl.control.trajectories import TrajectoryTable
from fnrl.policy.seeding import canonical_order
from fnrl.trainer.batching import make_batch
from fnrl.types import Consume, Group


class StalenessViolation(AssertionError):
    """A consumed batch holds a token older than the bound allows: a coordinator bug."""


class TrainWatch(Protocol):
    """What training tells the fault detector (fnrl.control.supervisor)."""

    def train_started(self, step: int) -> None: ...

    def train_returned(self) -> None: ...

    def train_raised(self, err: Exception) -> None: ...


def corrupt_logprobs(arrays: dict, shift: float, *, seed: int) -> dict:
    """FAULT INJECTION (`--faults.inject.bad-logprobs`): the behaviour log-probs recorded
    for a batch, each lowered by uniform noise in [0, shift] on response tokens."""
    rng = np.random.default_rng(seed)
    logp = arrays["behaviour_logp_BxT"]
    noise = rng.uniform(0.0, shift, logp.shape).astype(logp.dtype) * (arrays["mask_BxT"] > 0)
    return {**arrays, "behaviour_logp_BxT": logp - noise}


def check_bound(groups: tuple[Group, ...], version: int, eta: int) -> tuple[int, int]:
    """StaleFlow §4.2 on every consumed sampled token: V_token + η ≥ V_buf. Returns the
    tokens checked and the largest staleness seen; raises StalenessViolation naming the
    group."""
    tokens, worst = 0, 0
    for g in groups:
        for tr in g.trajectories:
            for s in tr.segments:
                if s.fed or not s.token_ids:
                    continue   # fed ids (tool results) have no policy version; empty: none
                if s.version + eta < version:
                    raise StalenessViolation(
                        f"group {g.problem.uid} has a token of version {s.version}, too old "
                        f"for buffer {version} (η={eta})")
                tokens += len(s.token_ids)
                worst = max(worst, version - s.version)
    return tokens, worst


class Training:
    def __init__(self, cfg: RunConfig, trainer: TrainerHandle, *, table: TrajectoryTable,
                 consumed: ConsumedLog, journal, task: TaskIO, book: Book, svc: Services,
                 watch: TrainWatch, on_step: Callable[[dict, dict], None], gating=None):
        self.cfg, self.trainer, self.table, self.consumed = cfg, trainer, table, consumed
        self.gating = gating   # fnrl.control.gating.Gating, or None: no gates
        self.journal, self.task, self.book, self.svc = journal, task, book, svc
        self.watch, self.on_step = watch, on_step
        self.durations: list[float] = []
        self.restarts, self.restored = 0, -1
        self._restart = asyncio.Event()   # set (and replaced) by each restart

    def consume(self, cmd: Consume) -> None:
        """Applies a Consume to the bookkeeping now; the step runs as a task."""
        gids = canonical_order(cmd.gids) if self.cfg.deterministic else cmd.gids
        names = [self.table.groups[g].name for g in gids]
        self.journal.write("consume", version=cmd.version, groups=names)
        self.book.trainer_busy = True
        self.svc.spawn(self._train(cmd, self.table.consume(gids)))

    def restarted(self, version: int) -> None:
        """The supervisor replaced the trainer; it restored `version`."""
        self.restarts, self.restored = self.restarts + 1, version
        self._restart.set()
        self._restart = asyncio.Event()

    def typical_step_s(self) -> float:
        recent = sorted(self.durations[-10:])
        return recent[len(recent) // 2] if recent else 0.5

    async def _train(self, cmd: Consume, groups: tuple[Group, ...]) -> None:
        b = self.book
        if cmd.version != b.trainer_version:
            raise StalenessViolation(f"Consume names version {cmd.version} but the trainer "
                                     f"is at {b.trainer_version}")
        eta = self.cfg.coord.eta
        checked, worst = check_bound(groups, cmd.version, eta)
        arrays, stats = make_batch(groups, b.trainer_version, algo=self.cfg.algo,
                                   trainer=self.cfg.trainer, seq_len=self.task.seq_len,
                                   pad_id=self.task.pad_id, episodes=self.cfg.task.env != "math")
        if cmd.version + 1 == self.cfg.faults.inject.bad_logprobs:
            arrays = corrupt_logprobs(arrays, self.cfg.faults.inject.logprob_shift,
                                      seed=self.cfg.seed)
        rollback, controls = -1, {}
        if self.gating is not None:
            controls = self.gating.controls()
            arrays = {**arrays, **controls}
            rollback = self.gating.sent()
        result, t0 = await self._call(cmd.version, arrays)
        t1 = self.svc.clock.now()
        self.durations.append(t1 - t0)
        b.time["train_call_s"] += t1 - t0
        b.last_train_end_s = t1 - self.svc.t0
        self.svc.event("train", t0=t0, version=cmd.version)
        for g in groups:
            self.consumed.log(g.problem.uid, cmd.version, g.trajectories)
        # The gates' controls went with the batch: a replay (fnrl.experiments.replay)
        # sends the same ones.
        self.journal.write("trained", version=cmd.version,
                           **({"controls": {k: v.item() for k, v in controls.items()}}
                              if controls else {}))
        for g in groups:   # recorded: a restarted controller will not train them again
            self.consumed.release(g.trajectories)
        skipped = result.version == cmd.version
        b.skipped_steps += skipped
        b.counts["skipped_updates"] += skipped
        # Refused by a gate: the version advanced, the weights did not (fnrl.trainer.step).
        b.counts["refused_updates"] += bool(result.metrics.get("gate_refused", 0.0))
        b.trainer_version = result.version
        b.steps_done += 1
        b.trained_tokens += stats["tokens"]
        b.tokens_at_version[b.trainer_version] = b.trained_tokens   # for eval records
        b.checked_tokens += checked
        b.max_staleness = max(b.max_staleness, worst)
        b.counts["consumed_groups"] += len(groups)
        b.trainer_busy = False
        self.on_step(dict(result.metrics), {**stats, "eta": eta, "staleness_checked_tokens": checked,
                                            "staleness_checked_max": worst})
        if self.gating is not None:
            self.gating.observe(dict(result.metrics), stats, version=cmd.version,
                                new_version=result.version, rollback_sent=rollback)
        self.svc.wake()

    async def _call(self, version: int, arrays) -> tuple[TrainResult, float]:
        """Trains version → version + 1 on `arrays`. If the trainer fails during the step,
        waits for the supervisor to restart it from its newest checkpoint, then sends the
        same batch again, unless that checkpoint already holds this step (the trainer
        died after saving it): the step is then taken as done, without its metrics."""
        while True:
            seen, restart = self.restarts, self._restart
            self.watch.train_started(version + 1)
            t0 = self.svc.clock.now()
            try:
                result = await self.trainer.train(arrays)
                self.watch.train_returned()
                return result, t0
            except RoleError as err:
                self.book.counts["train_retries"] += 1
                if self.restarts == seen:   # the trainer it went to failed: wait for the next
                    self.watch.train_raised(err)
                    await restart.wait()
            restored = self.restored
            if restored == version + 1:
                self.book.counts["steps_recovered_from_checkpoint"] += 1
                self.watch.train_returned()
                return TrainResult(restored, {"recovered_from_checkpoint": 1.0}), t0
            if restored != version:
                raise StalenessViolation(f"the restarted trainer resumed at version {restored}, "
                                         f"but the batch in flight trains version {version}")
