"""The controller loop: observe → decide → act, over role handles; nothing else
changes the job.

Each tick freezes the controller's bookkeeping into a ClusterSnapshot and each role's
health into RoleHealth values; the pure `fnrl.policy.schedule.decide` (the StaleFlow
cycle under every preset) and `fnrl.policy.faults.decide_faults` return commands; `act`
applies each one to the bookkeeping at once, in order, starting a task for its I/O
(fnrl.control.generation for rollouts, .training for the trainer, .supervisor for
restarts). So the next snapshot already reflects every command issued (the
speculative state P matches it) while the I/O lands in the background. The loop wakes
on every finished trajectory, landed pull or returned step, and on a short tick.

The roles are handles (fnrl.control.handles): local processes, simulated roles on virtual
time (fnrl.sim.handles, which the tests' fakes configure), or any other; the clock too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fnrl.config import RunConfig
from fnrl.control import journal, recovery, report
from fnrl.control.book import Book, Services, TaskIO
from fnrl.control.eval_lane import EvalLane
from fnrl.control.gating import Gating
from fnrl.control.generation import Generation
from fnrl.control.handles import ClusterLost, Clock, MonotonicClock, Roles
from fnrl.control.supervisor import JobRestart, Supervisor
from fnrl.control.trajectories import TrajectoryTable
from fnrl.control.training import Training
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.policy import faults, schedule
from fnrl.shell import aio
from fnrl.shell.files import no_space
from fnrl.types import Abort, Consume, DropGroups, Evaluate, FillPrompts, Interrupt, Migrate, Pull, Route

TICK_S = 0.1
TASKS_GRACE_S = 30.0   # for the loop's tasks to end once cancelled (fnrl.shell.aio)
PROGRESS_EVERY_S = 2.0    # attempts.jsonl: how stale a killed controller's record may be


class Controller:
    """Drives one attempt of a run over `roles`. Roles are started and stopped by the
    caller; a previous attempt's journal and pool in `run_dir` are recovered."""

    def __init__(self, cfg: RunConfig, roles: Roles, task: TaskIO, *, run_dir: Path, writer,
                 trainer_version: int, clock: Clock | None = None, log=None):
        self.cfg, self.roles, self.task, self.run_dir, self.writer = cfg, roles, task, run_dir, writer
        self.log = log or tqdm.write
        self.svc = Services(clock or MonotonicClock())
        self.table = TrajectoryTable()
        self.pool = PartialResponsePool(run_dir / "partial_responses.log", fsync=cfg.fsync_logs)
        path = run_dir / "journal.jsonl"
        self.replayed = journal.replay(path, trainer_version=trainer_version)
        self.journal = journal.Journal(path, fsync=cfg.fsync_logs)
        steps = max(trainer_version, self.replayed.trained_steps)
        self.book = Book(trainer_version=trainer_version, steps_done=steps)
        recovery.count_pool_recovery(self.pool, self.book.counts, self.log)
        self.consumed = recovery.ConsumedLog(run_dir / "trajectories.jsonl", self.pool)
        self.attempts = report.Attempts(run_dir)
        # Idle rollouts evaluate only when no evaluation server is given (eval_lane).
        self._eval_on_rollouts = cfg.eval.server != "off" and roles.evaluator is None
        self.plan = schedule.plan(cfg.coord, batch_groups=cfg.algo.groups_per_step,
                                  prompt_groups=cfg.rollout.queued_groups, total_steps=cfg.steps,
                                  eval_every=(cfg.eval.every if self._eval_on_rollouts
                                              else schedule.NEVER))
        self.state: schedule.ScheduleState | None = None
        self.supervisor = Supervisor(cfg.faults, roles, book=self.book, svc=self.svc, run_dir=run_dir)
        self.generation = Generation(cfg, roles.rollouts, roles.relays, table=self.table,
                                     pool=self.pool, journal=self.journal, task=task, book=self.book,
                                     svc=self.svc, progress=self.supervisor, writer=writer, log=self.log,
                                     tools=roles.tools)
        # The correctness gates (fnrl.policy.gates) judge every returned step.
        self.gating = Gating(cfg, run_dir=run_dir, journal=self.journal, writer=writer,
                             log=self.log, version=trainer_version,
                             lr_scale=self.replayed.gate_lr_scale,
                             rollbacks=self.replayed.gate_rollbacks)
        self.training = Training(cfg, roles.trainer, table=self.table, consumed=self.consumed,
                                 journal=self.journal, task=task, book=self.book, svc=self.svc,
                                 watch=self.supervisor, on_step=self._log_step,
                                 gating=self.gating)
        self.supervisor.generation, self.supervisor.training = self.generation, self.training
        self.eval_lane = (EvalLane(cfg, roles.evaluator, roles.relays, task=task, book=self.book,
                                   svc=self.svc, writer=writer, reward=self.generation.reward,
                                   log=self.log)
                          if roles.evaluator is not None and cfg.eval.server != "off" else None)
        self._last_obs = self._last_step = self._last_progress = 0.0
        self.bar = None

    # --- the loop ---------------------------------------------------------------------

    async def run(self) -> dict:
        self.bar = tqdm(total=self.cfg.steps, initial=self.book.steps_done, desc="rl", unit="step",
                        dynamic_ncols=True)
        try:
            await self.generation.start()
            eval_t0 = self.svc.clock.now()
            await self.evaluate_now()
            # Recorded so a job restart's gap can leave the evaluation out: a role restart
            # never pays it (report.across_attempts).
            eval_before_s = self.svc.clock.now() - eval_t0
            self.svc.restart_clock()
            self.book.time.clear()
            self.attempts.write("start", self.svc.t0_epoch, eval_before_s=eval_before_s)
            self.supervisor.start()
            self.state = schedule.init_schedule(
                self.plan, [r.version for r in self.generation.rollouts],
                v_train=self.book.trainer_version, steps_done=self.book.steps_done)
            self.state = recovery.recover(
                self.replayed, self.state, eta=self.cfg.coord.eta, table=self.table, pool=self.pool,
                journal=self.journal, consumed=self.consumed, task=self.task, book=self.book,
                reward_group=self.generation.reward_group, writer=self.writer, log=self.log)
            while not self.tick():
                await self._wait()
                self.svc.reap()
            wall, eval_in_loop = self.svc.now(), self.book.time["eval_s"]
            await self.generation.stop_streams()
            await self.supervisor.settle()
            self.svc.reap()   # a restart that failed for good raises here
            await self.evaluate_now()
            summary = self.summary(wall, eval_in_loop)
            # Dated at the loop's end: the final evaluation is not run time (ETTR's wall).
            self.attempts.write("end", self.svc.t0_epoch + wall, **self._progress(wall))
            return summary
        except (JobRestart, ClusterLost) as err:
            # Every role restarts (down time kept), or a named end (a re-run resumes).
            end = ({"cluster_lost": str(err)} if isinstance(err, ClusterLost)
                   else {"job_restart": True})
            if "cluster_lost" in end:
                self.supervisor.record("cluster_lost", reason=str(err))
            self.attempts.write("end", self.svc.clock.epoch(), **end, **self._progress(self.svc.now()))
            raise
        except Exception as err:
            if not no_space(err):
                raise
            raise self.attempts.stop_on_full_disk(err, self.svc.clock.epoch(),
                                                  **self._progress(self.svc.now())) from None
        finally:
            # Ended here, while the HTTP session and the pool they write to are open.
            await aio.cancel_and_wait(self.svc.tasks, TASKS_GRACE_S)
            await self.generation.close_tools()   # the sandbox's workers (multi-turn)
            self.bar.close()
            for closing in (self.supervisor, self.journal, self.consumed, self.pool):
                self.attempts.closing(closing.close)
            self.attempts.closing(lambda: (self.run_dir / "timeline.json").write_text(
                json.dumps(self.svc.timeline)))
            self.attempts.close()

    async def evaluate_now(self) -> None:
        """Held-out evaluation of the trainer's newest version, awaited (at the start and
        the end of an attempt): on the evaluation server, or on rollout 0."""
        if self.eval_lane is not None:
            await self.eval_lane.finish(self.book.trainer_version)
        elif self._eval_on_rollouts:
            await self.generation.evaluate_now()

    def tick(self) -> bool:
        """One observe → decide → act; True once the run is done. Roles' health goes
        first: a failed rollout's work is back in the TS before the snapshot the
        schedule decides on is taken."""
        for cmd in self.decide_faults(self.observe_health()):
            self.act(cmd)
        snap = self.observe()
        if schedule.finished(self.state, self.plan, trainer_idle=not self.book.trainer_busy):
            return True
        if self.gating.stop_report is not None and not self.book.trainer_busy:
            return True   # a gate stopped the run: wound down like a finished one
        for cmd in self.decide(snap):
            self.act(cmd)
        return False

    async def _wait(self) -> None:
        """Until something lands (a task calls `svc.wake`) or a tick passes."""
        wake = self.svc.wake_event
        waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(self.svc.clock.sleep(TICK_S))]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        wake.clear()

    # --- observe --------------------------------------------------------------------------

    def observe_health(self):
        self.roles.relays.check()
        self.supervisor.relay_repairs()
        placed = np.zeros(len(self.roles.rollouts), np.int64)
        for t in self.table.trajs.values():
            if t.live and t.inst >= 0:
                placed[t.inst] += 1
        return self.supervisor.health(placed)

    def observe(self):
        now = self.svc.now()
        dt, self._last_obs = now - self._last_obs, now
        b, rollouts = self.book, self.generation.rollouts
        rewarded, dropped = self.table.take_events()
        snap = self.table.snapshot(
            now_s=now, ps_version=b.trainer_version, trainer_idle=not b.trainer_busy,
            inst_version_R=[r.version for r in rollouts],
            inst_kv_prev_R=[r.kv_prev for r in rollouts],
            # A failed rollout has no room: nothing is routed, migrated or pulled there.
            inst_kv_capacity_R=[0.0 if r.down else r.kv_capacity for r in rollouts],
            inst_num_complete_R=[r.complete for r in rollouts],
            waiting_counts=[r.waiting for r in rollouts], rewarded_gids=rewarded,
            dropped_gids=dropped,
            inst_max_seqs_R=[self.cfg.rollout.max_num_seqs] * len(rollouts))
        snap = dataclasses.replace(snap, skipped_steps=b.skipped_steps)
        b.skipped_steps = 0
        placed = report.account_rollouts(rollouts, snap, dt,
                                         trainer_down=self.supervisor.down("trainer"))
        if not self.svc.timeline or now - self.svc.timeline[-1]["t"] >= 0.25:
            self.svc.timeline.append({"t": now, "running": placed.tolist(),
                                      "tokens": [r.tokens for r in rollouts],
                                      "versions": snap.inst_version_R.tolist(),
                                      "trainer_busy": b.trainer_busy})
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.attempts.write("progress", self.svc.clock.epoch(), **self._progress(now))
        return snap

    # --- decide ---------------------------------------------------------------------------

    def decide_faults(self, health) -> tuple:
        sup = self.supervisor
        sup.history, restarts = faults.decide_faults(self.svc.now(), health, sup.history,
                                                     step=self.book.trainer_version, cfg=self.cfg.faults)
        return restarts

    def decide(self, snap) -> tuple:
        pulling = any(r.pull_task is not None for r in self.generation.rollouts)
        self.state, reset = schedule.reconcile(self.state, snap, pulls_in_flight=pulling)
        self.book.counts["speculative_resets"] += reset
        self.state, cmds = schedule.decide(snap, self.state, self.plan)
        return cmds

    # --- act ------------------------------------------------------------------------------

    def act(self, cmd) -> None:
        """Applies `cmd` to the bookkeeping now; its I/O runs as a task."""
        counts, gen = self.book.counts, self.generation
        report.count_command(counts, cmd)
        if isinstance(cmd, FillPrompts):
            gen.fill(cmd.num_groups)
        elif isinstance(cmd, Route):
            gen.route(cmd.tids, cmd.rid)
        elif isinstance(cmd, Interrupt):
            gen.interrupt(cmd.tids, cmd.rid)
        elif isinstance(cmd, Migrate):
            gen.migrate(cmd.tids, cmd.src, cmd.dst)
        elif isinstance(cmd, Abort):
            gen.abort(cmd.tids, cmd.rid)
        elif isinstance(cmd, DropGroups):
            gen.drop_groups(cmd.gids)
        elif isinstance(cmd, Pull):
            counts["pulls" if gen.pull(cmd.rid) else "pulls_skipped_down"] += 1
        elif isinstance(cmd, Consume):
            self.training.consume(cmd)
        elif isinstance(cmd, Evaluate):
            gen.evaluate(cmd.rid)
        elif isinstance(cmd, (faults.RestartRole, faults.RestartJob)):
            self.supervisor.act(cmd)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    # --- report ---------------------------------------------------------------------------

    def _log_step(self, trainer_metrics: dict, stats: dict) -> None:
        b, now = self.book, self.svc.now()
        record = report.step_record(b, self.generation.rollouts, trainer_metrics, stats,
                                    preset=self.cfg.preset or "custom", wall_s=now,
                                    since_last_step_s=now - self._last_step)
        self._last_step = now
        self.writer.write("train", b.trainer_version, record)
        if self.eval_lane is not None:   # published before the step returned
            self.eval_lane.version_trained(b.trainer_version)
        self.attempts.write("progress", self.svc.clock.epoch(), **self._progress(now))
        shown = dict(reward=f"{stats['reward_mean']:.2f}")
        if b.last_eval:   # no accuracy yet, or evaluation off: none shown (not "nan%")
            shown["acc"] = f"{100 * b.last_eval['accuracy']:.0f}%"
        self.bar.set_postfix(**shown, stale=f"{stats['staleness_mean']:.2f}")
        self.bar.update(1)

    def _progress(self, wall: float) -> dict:
        return report.progress(self.book, self.supervisor.outages, self.generation.rollouts,
                               num_relays=len(self.roles.relays.names), wall_s=wall)

    def summary(self, wall: float, eval_in_loop: float) -> dict:
        eval_server = ("off" if self.cfg.eval.server == "off" else
                       "dedicated" if self.eval_lane is not None else "rollout")
        return report.attempt_summary(
            self.book, self.generation.rollouts, self.supervisor.outages,
            failures=self.supervisor.failures, num_relays=len(self.roles.relays.names),
            eta=self.cfg.coord.eta, eval_server=eval_server, gates=self.gating.summary(),
            wall_s=wall, eval_in_loop_s=eval_in_loop)
