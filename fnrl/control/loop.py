"""The controller loop: observe → decide → act, and nothing else changes the job.

Each tick freezes the controller's bookkeeping into a ClusterSnapshot, the pure
`fnrl.policy.schedule.decide` (the StaleFlow cycle under every preset) returns
commands, and `act` applies each one to the bookkeeping at once, in order, starting
an asyncio task for its I/O. So the next snapshot already reflects every command
issued (the speculative state P matches it) while the I/O lands in the background:
- Route: one streaming request per trajectory (n = 1); every token and log-prob goes
  to the partial response pool before it counts. A trajectory with tokens continues
  from them: prompt + streamed tokens are re-prefilled with the remaining budget,
  and its next tokens carry the version the rollout serves now.
- Interrupt / Migrate / Abort: cancel the stream (vLLM aborts a request whose client
  went away); a later Route of the same trajectory waits for that cancel to land.
- Pull: waits for the rollout's interrupted streams and evaluations, then loads the
  relay's newest weights; the rollout's version changes when it lands.
- Consume: takes exactly the named groups from the experience buffer, asserts the
  staleness bound on every token, and trains.
The loop wakes on every finished trajectory, landed pull or returned step, and on a
short tick that checks that every role is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from fnrl.config import RunConfig
from fnrl.control import journal, recovery, report, wire
from fnrl.control.metrics import MetricsWriter
from fnrl.control.roles import Cluster
from fnrl.control.supervisor import JobRestart, Supervisor
from fnrl.control.trajectories import IN_TS, TrajectoryTable, Tracked
from fnrl.control.workload import forced_length
from fnrl.data import experience
from fnrl.data.arith import Problem, PromptStream
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.data.reward import checked_reward
from fnrl.policy import schedule
from fnrl.policy.routing import SpeculativeState, snapshot_is_valid
from fnrl.serving.client import RolloutClient, ServerError
from fnrl.losses.advantages import informative
from fnrl.trainer.batching import make_batch
from fnrl.types import (Abort, Consume, DropGroups, Evaluate, FillPrompts, Group, Interrupt,
                        Migrate, Pull, Route, Trajectory)

TICK_S = 0.1
PULL_ATTEMPTS = 4
PULL_RELAY_TIMEOUT_S = 10.0   # a dead relay is retried on a survivor after this


class StalenessViolation(AssertionError):
    """A consumed batch holds a token older than the bound allows: a coordinator bug."""


@dataclass
class RolloutState:
    client: RolloutClient
    version: int = 0
    kv_capacity: float = 1.0
    kv_prev: float = 0.0
    complete: int = 0                 # trajectories finished here since its last Pull
    waiting: int = 0                  # vLLM's waiting-queue length, from /metrics
    pull_task: asyncio.Task | None = None
    evals: set = field(default_factory=set)      # evaluation tasks running here
    streams: set = field(default_factory=set)    # stream tasks placed here, not done
    active_s: float = 0.0             # time with at least one trajectory placed
    down: bool = False                # failed; being restarted (no routing, no pulls)
    kv_token_s: float = 0.0           # ∫ KV in use dt, for the mean utilization


@dataclass
class Bookkeeping:
    """Mutable controller state, touched only by the loop and its tasks (one thread)."""

    trainer_version: int
    steps_done: int
    trainer_busy: bool = False
    buffer: experience.ExperienceBuffer = field(default_factory=experience.ExperienceBuffer)
    invalid_trajectories: int = 0
    generated_tokens: int = 0
    trained_tokens: int = 0
    counts: Counter = field(default_factory=Counter)
    time: Counter = field(default_factory=Counter)
    last_eval: dict | None = None
    evaluated_versions: list[int] = field(default_factory=list)


class Controller:
    """Drives one run. Role processes are started and stopped by the caller."""

    def __init__(self, cfg: RunConfig, *, cluster: Cluster, trainer: wire.RoleClient,
                 relay_for: Callable[[int], str], rollouts: list[RolloutClient], prompts: PromptStream,
                 eval_set: list[Problem], encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], reward_fn: Callable[[str, str], float],
                 eos_id: int, pad_id: int, seq_len: int, writer: MetricsWriter,
                 trainer_version: int, run_dir: Path):
        self.cfg, self.cluster = cfg, cluster
        self.relay_for = relay_for  # rollout index -> address of the relay it pulls from
        self.rollouts = [RolloutState(c) for c in rollouts]
        self.prompts, self.eval_set = prompts, eval_set
        self.encode, self.decode, self.reward_fn = encode, decode, reward_fn
        self.eos_id, self.pad_id, self.seq_len = eos_id, pad_id, seq_len
        self.writer, self.run_dir = writer, run_dir
        self.book = Bookkeeping(trainer_version=trainer_version, steps_done=trainer_version)
        self.trainer = trainer
        self.table = TrajectoryTable()
        self.pool = PartialResponsePool(run_dir / "partial_responses.log",
                                        fsync=cfg.coord.pool_fsync)
        # What a previous controller of this run left (nothing on a fresh run): recovered
        # in `_recover` once the schedule exists.
        self.journal_path = run_dir / "journal.jsonl"
        self.replayed = journal.replay(self.journal_path, trainer_version=trainer_version)
        self.journal = journal.Journal(self.journal_path, fsync=cfg.coord.pool_fsync)
        self.plan = schedule.SchedulePlan(
            cycle=schedule.cycle_config(cfg.coord, batch_groups=cfg.algo.groups_per_step,
                                        prompt_groups=cfg.rollout.groups_per_batch),
            total_steps=cfg.steps, eval_every=cfg.eval_every)
        self.state: schedule.ScheduleState | None = None
        self.tasks: set[asyncio.Task] = set()
        self.wake = asyncio.Event()
        self.timeline: list[dict] = []
        self._trajectory_log = open(run_dir / "trajectories.jsonl", "a", buffering=1)
        self._t0 = self._last_obs = self._last_step_t = time.perf_counter()
        self._last_train_end = self._t0
        self._eval_s_in_loop = 0.0
        self._train_durations: list[float] = []
        self._batch_shapes: set = set()
        self._t0_epoch = time.time()
        self._restored_version: int | None = None
        self.trainer_generation = 0
        self.supervisor = Supervisor(self, cfg.faults)

    # --- observe ------------------------------------------------------------------

    def observe(self):
        now = time.perf_counter()
        dt, self._last_obs = now - self._last_obs, now
        b = self.book
        snap = self.table.snapshot(
            now_s=now - self._t0, ps_version=b.trainer_version,
            trainer_idle=not b.trainer_busy,
            inst_version_R=[r.version for r in self.rollouts],
            inst_kv_prev_R=[r.kv_prev for r in self.rollouts],
            # A failed rollout has no room: nothing is routed, migrated or pulled there.
            inst_kv_capacity_R=[0.0 if r.down else r.kv_capacity for r in self.rollouts],
            inst_num_complete_R=[r.complete for r in self.rollouts],
            waiting_counts=[r.waiting for r in self.rollouts])
        placed = np.bincount(snap.traj_inst_N[snap.traj_inst_N >= 0], minlength=len(self.rollouts))
        self.placed = placed
        for r, state in enumerate(self.rollouts):
            state.active_s += dt * bool(placed[r])
            state.kv_token_s += dt * float(snap.inst_kv_used_R[r])
            state.kv_prev = float(snap.inst_kv_used_R[r])
        if not self.timeline or now - self.timeline[-1]["t"] >= 0.25:
            self.timeline.append({"t": now - self._t0, "running": placed.tolist(),
                                  "versions": snap.inst_version_R.tolist(),
                                  "trainer_busy": b.trainer_busy})
        return snap

    # --- the loop -----------------------------------------------------------------

    async def run(self) -> dict:
        bar = tqdm(total=self.cfg.steps, initial=self.book.steps_done, desc="rl", unit="step",
                   dynamic_ncols=True)
        self._bar = bar
        try:
            for r in self.rollouts:
                r.kv_capacity = float(self.cfg.rollout.kv_capacity_tokens
                                      or await r.client.kv_capacity_tokens())
            await self._evaluate(self.rollouts[0])
            # One request per server first, so no server's first batch (lazy kernel set-up
            # in the engine) lands inside the measured window.
            probe = self.encode(self.eval_set[0].prompt)
            await asyncio.gather(*(r.client.generate(probe, n=1, max_tokens=4, temperature=1.0,
                                                     seed=0) for r in self.rollouts))
            self._t0 = self._last_obs = self._last_step_t = time.perf_counter()
            self._t0_epoch = time.time()
            self.book.time.clear()
            self.supervisor.start(self.book.steps_done)
            self.state = schedule.init_schedule(
                self.plan, [r.version for r in self.rollouts], v_train=self.book.trainer_version,
                steps_done=self.book.steps_done)
            recovery.recover(self)
            self._spawn(self.supervisor.heartbeats())
            while True:
                self.cluster.check()
                snap = self.observe()
                self.supervisor.tick(self.placed)
                if schedule.finished(self.state, self.plan, trainer_idle=not self.book.trainer_busy):
                    break
                pulling = any(r.pull_task is not None for r in self.rollouts)
                if not pulling and not snapshot_is_valid(self.state.cycle.speculative, snap):
                    # Only a pull lands late; with none in flight P must match what is
                    # observed. If not, a pull got another version than P assumed.
                    self.book.counts["speculative_resets"] += 1
                    self.state = dataclasses.replace(self.state, cycle=dataclasses.replace(
                        self.state.cycle, speculative=SpeculativeState.from_snapshot(snap)))
                self.state, cmds = schedule.decide(snap, self.state, self.plan)
                for cmd in cmds:
                    self.act(cmd)
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), TICK_S)
                except asyncio.TimeoutError:
                    pass
                self._reap()
            wall = time.perf_counter() - self._t0
            self._eval_s_in_loop = self.book.time["eval_s"]
            await self._shutdown_streams()
            await self._final_eval()
        except JobRestart as err:
            # The job runner restarts every role; it needs this attempt's down time.
            err.stats = {**self.supervisor.ettr(time.perf_counter() - self._t0),
                         "wall_s": time.perf_counter() - self._t0}
            raise
        finally:
            for t in self.tasks:
                t.cancel()
            bar.close()
            self.supervisor.close()
            self.journal.close()
            self._trajectory_log.close()
            self.pool.close()
            (self.run_dir / "timeline.json").write_text(json.dumps(self.timeline))
        return report.summary(self, wall)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        return task

    def _reap(self) -> None:
        """Re-raises, in the loop, the failure of any finished task."""
        for t in [t for t in self.tasks if t.done()]:
            self.tasks.discard(t)
            if not t.cancelled():
                t.result()

    async def _shutdown_streams(self) -> None:
        """Stops generation at the end: what was streamed stays in the pool."""
        live = [t.task for t in self.table.trajs.values() if t.task is not None and not t.task.done()]
        for task in live:
            task.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        self.book.counts["unfinished_at_end"] = sum(t.live and t.tokens > 0
                                                    for t in self.table.trajs.values())

    async def _final_eval(self) -> None:
        if self.book.trainer_version in self.book.evaluated_versions:
            return
        rollout = self.rollouts[0]
        if rollout.pull_task is not None:
            await rollout.pull_task
        await asyncio.gather(*rollout.evals, return_exceptions=True)
        if rollout.version < self.book.trainer_version:
            rollout.version = await rollout.client.pull(
                self.relay_for(0), min_version=self.book.trainer_version)
        await self._evaluate(rollout)

    # --- act ----------------------------------------------------------------------

    def act(self, cmd) -> None:
        """Applies `cmd` to the bookkeeping now; its I/O runs as a task."""
        counts = self.book.counts
        if isinstance(cmd, FillPrompts):
            for problem in self.prompts.take(cmd.num_groups):
                prompt_ids = tuple(self.encode(problem.prompt))
                base = len(self.table.trajs)
                lens = [forced_length(self.cfg.rollout, self.cfg.seed, base + k)
                        for k in range(self.cfg.algo.group_size)]
                room = self.seq_len - len(prompt_ids)   # vLLM: prompt + max_tokens ≤ max_model_len
                lens = [None if n is None else min(n, room) for n in lens]
                rec = self.table.add_group(problem, prompt_ids, lens)
                self.journal.write("fill", problem=dataclasses.asdict(problem), lens=lens,
                                   uids=[self.table.trajs[i].uid for i in rec.tids])
        elif isinstance(cmd, Route):
            for tid in cmd.tids:
                self._place(self.table.trajs[tid], cmd.rid)
            counts["routed"] += len(cmd.tids)
        elif isinstance(cmd, Interrupt):
            for tid in cmd.tids:
                self._unplace(self.table.trajs[tid], cmd.rid)
            counts["interrupted"] += len(cmd.tids)
        elif isinstance(cmd, Migrate):
            for tid in cmd.tids:
                t = self.table.trajs[tid]
                self._unplace(t, cmd.src)
                self._place(t, cmd.dst)
            counts["migrated"] += len(cmd.tids)
            counts["repacks"] += 1
        elif isinstance(cmd, Abort):
            for tid in cmd.tids:
                t = self.table.trajs[tid]
                if cmd.rid is not None:
                    self._unplace(t, cmd.rid)
                t.aborted = True
                self.pool.drop(t.uid)
            counts["aborted"] += len(cmd.tids)
        elif isinstance(cmd, DropGroups):
            self.journal.write("drop", groups=[self.table.groups[g].problem.uid for g in cmd.gids])
            self.book.buffer = experience.discard(self.book.buffer, cmd.gids)
            for gid in cmd.gids:
                self.table.groups[gid].dropped = True
            counts["dropped_groups"] += len(cmd.gids)
        elif isinstance(cmd, Pull):
            rollout = self.rollouts[cmd.rid]
            if rollout.down:
                counts["pulls_skipped_down"] += 1   # it pulls the newest when it is back
                return
            rollout.complete = 0
            # Waits only for tasks issued before it (so no two tasks wait on each other).
            # The cycle planned with the trainer's newest version on this rollout.
            rollout.pull_task = self._spawn(self._pull(cmd.rid, list(rollout.streams),
                                                       list(rollout.evals),
                                                       self.book.trainer_version))
            counts["pulls"] += 1
        elif isinstance(cmd, Consume):
            self.journal.write("consume", version=cmd.version,
                               groups=[self.table.groups[g].problem.uid for g in cmd.gids])
            self.book.trainer_busy = True
            self.book.buffer, batch = self._take(cmd.gids)
            self._spawn(self._train(cmd, batch))
        elif isinstance(cmd, Evaluate):
            rollout = self.rollouts[cmd.rid]
            if rollout.down:
                return
            task = self._spawn(self._evaluate(rollout, after=rollout.pull_task))
            rollout.evals.add(task)
            task.add_done_callback(rollout.evals.discard)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _place(self, t: Tracked, rid: int) -> None:
        assert t.live and t.inst == IN_TS, (t.tid, t.inst, rid)
        t.inst, t.started = rid, False
        t.placements += 1
        rollout = self.rollouts[rid]
        t.task = self._spawn(self._stream(t, rid, prior=t.task, pull=rollout.pull_task,
                                          evals=list(rollout.evals)))
        rollout.streams.add(t.task)
        t.task.add_done_callback(rollout.streams.discard)

    def _unplace(self, t: Tracked, rid: int) -> None:
        assert t.live and t.inst == rid, (t.tid, t.inst, rid)
        t.inst = IN_TS
        if t.task is not None:
            t.task.cancel()

    def _take(self, gids):
        batch, buffer = experience.take(self.book.buffer, gids)
        return buffer, batch

    # --- rollout I/O ----------------------------------------------------------------

    async def _lost(self, rid: int, wait_s: float = 1.0) -> bool:
        """Whether rollout `rid` failed (known, killed, or its process is gone), so that
        an I/O error on it is the failure's and the supervisor moves its work elsewhere.
        A dying server closes its sockets before its exit is visible: wait a little."""
        name = f"rollout{rid}"
        for _ in range(int(wait_s / 0.05) + 1):
            if (self.rollouts[rid].down or name in self.supervisor.pending_kills
                    or self.cluster.role(name).proc.poll() is not None):
                return True
            await asyncio.sleep(0.05)
        return False

    def rollout_failed(self, rid: int) -> None:
        """The supervisor restarts rollout `rid`: every trajectory on it goes back to the
        trajectory server, its streamed tokens kept in the pool."""
        rollout = self.rollouts[rid]
        rollout.down = True
        on = self.table.on(rid)
        for t in on:
            self._unplace(t, rid)
        rollout.complete, rollout.waiting = 0, 0
        self.book.counts["fault_interrupted"] += len(on)
        self.wake.set()

    def trainer_restarted(self, version: int) -> None:
        self._restored_version = version
        self.trainer_generation += 1

    def typical_step_s(self) -> float:
        return float(np.median(self._train_durations[-10:])) if self._train_durations else 0.5

    async def _stream(self, t: Tracked, rid: int, *, prior, pull, evals) -> None:
        try:
            await self._stream_once(t, rid, prior=prior, pull=pull, evals=evals)
        except ServerError:
            if not await self._lost(rid):
                raise
            # The rollout died under it: the trajectory stays placed until the supervisor
            # moves it back to the TS with what was streamed.

    async def _stream_once(self, t: Tracked, rid: int, *, prior, pull, evals) -> None:
        rollout = self.rollouts[rid]
        watch = self.supervisor.watches.get(f"rollout{rid}")
        if prior is not None:
            await asyncio.wait([prior])   # the interrupt of its last placement has landed
        if pull is not None:
            await asyncio.wait([pull])    # a Pull issued before this Route has landed
        if evals:
            await asyncio.wait(evals)     # evaluations have their rollout to themselves
        if t.uid not in self.pool:
            self.pool.start(t.uid, t.prompt_ids)
        item = self.pool.get(t.uid)
        streamed = tuple(tok for s in item.segments for tok in s.token_ids)
        budget = (t.target_len or self.cfg.algo.max_new_tokens) - len(streamed)
        if streamed:
            self.book.counts["reprefill_tokens"] += len(t.prompt_ids) + len(streamed)
            self.book.counts["continued"] += 1
        version = rollout.version
        reason = "length"
        if budget > 0:
            forced = t.target_len is not None
            stream = rollout.client.generate_stream(
                t.prompt_ids + streamed, max_tokens=budget,
                temperature=self.cfg.algo.temperature, seed=None,
                stop_token_ids=() if forced else (self.eos_id,), ignore_eos=forced,
                request_id=f"{t.uid}#{t.placements}")
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if chunk.token_ids:
                        # Durable before it counts: an interrupt or crash keeps it.
                        self.pool.append(t.uid, version, chunk.token_ids, chunk.logprobs)
                        t.tokens += len(chunk.token_ids)
                        t.started = True
                        self.book.generated_tokens += len(chunk.token_ids)
                        if watch is not None:
                            watch.last_progress_s = time.perf_counter() - self._t0
                    if chunk.finish_reason is not None:
                        reason = chunk.finish_reason
                        break
        self.pool.finish(t.uid, reason)
        t.finished = True
        rollout.complete += 1
        self.supervisor.progressed(f"rollout{rid}")
        self._group_done(t.gid)
        self.wake.set()

    def _reward(self, text: str, gold: str) -> float | None:
        """The verifier's reward, or None (the trajectory is invalid, and counted) when it
        raises or returns something non-finite: one bad answer never ends the job."""
        try:
            return checked_reward(self.reward_fn(text, gold))
        except Exception as err:  # noqa: BLE001 - any verifier failure marks the sample
            self.book.counts["reward_errors"] += 1
            if self.book.counts["reward_errors"] <= 3:
                self._bar.write(f"reward function raised on {text!r}: {type(err).__name__}: {err}")
            return None

    def _group_done(self, gid: int) -> None:
        """Rewards a group whose members have all finished, into the experience buffer."""
        rec = self.table.groups[gid]
        members = [self.table.trajs[i] for i in rec.tids]
        if not all(m.finished for m in members) or rec.dropped:
            return
        trajs = []
        for m in members:
            item = self.pool.get(m.uid)
            ids = [tok for s in item.segments for tok in s.token_ids]
            answer = ids[:ids.index(self.eos_id)] if self.eos_id in ids else ids
            reward = self._reward(self.decode(answer), rec.problem.answer)
            self.book.invalid_trajectories += reward is None
            trajs.append(Trajectory(uid=m.uid, prompt_ids=item.prompt_ids,
                                    segments=item.segments, finish_reason=item.finish_reason,
                                    reward=reward))
        if self.cfg.algo.dynamic_sampling and not informative([t.reward for t in trajs]):
            # DAPO dynamic sampling: a group whose rewards are all equal has no signal. It
            # is dropped like an aborted group, so the staleness buffer frees its entry and
            # the cycle admits another prompt: the batch stays full of informative groups.
            rec.dropped = True
            self.journal.write("drop", groups=[rec.problem.uid])
            self.table.dropped.append(gid)
            self.book.counts["dynamic_sampling_dropped"] += 1
            return
        self.book.buffer, _ = experience.add(self.book.buffer,
                                             [(gid, Group(rec.problem, tuple(trajs)))])
        self.table.rewarded.append(gid)

    async def _pull(self, rid: int, streams: list, evals: list, version: int) -> None:
        rollout = self.rollouts[rid]
        if streams:
            await asyncio.wait(streams)   # interrupted streams have closed
        if evals:
            await asyncio.wait(evals)     # an evaluation pins the version it started on
        t0 = time.perf_counter()
        for attempt in range(PULL_ATTEMPTS):
            try:
                # A live relay answers (and receives the version) within moments; a dead
                # one must not hold the engine, which does not generate during a pull.
                rollout.version = await rollout.client.pull(
                    self.relay_for(rid), relay_timeout_s=PULL_RELAY_TIMEOUT_S, min_version=version)
                break
            except ServerError:
                if await self._lost(rid):
                    rollout.pull_task = None   # it pulls the newest when it is back
                    return
                if attempt == PULL_ATTEMPTS - 1:
                    raise
                # Its relay died mid-pull: the tier splices it out within a heartbeat,
                # and `relay_for` then names a survivor.
                self.book.counts["pull_retries"] += 1
                await asyncio.sleep(0.5 * (attempt + 1))
        t1 = time.perf_counter()
        self.book.time["pull_s"] += t1 - t0
        self.timeline.append({"t": t1 - self._t0, "event": "pull", "rid": rid,
                              "t0": t0 - self._t0, "version": rollout.version})
        rollout.pull_task = None
        self.wake.set()

    async def _evaluate(self, rollout: RolloutState, *, after=None) -> None:
        """Greedy held-out accuracy of the version `rollout` serves (after a pending pull)."""
        if after is not None:
            await asyncio.wait([after])
        version = rollout.version
        t0 = time.perf_counter()

        async def one(problem: Problem) -> tuple[int, float]:
            (c,) = await rollout.client.generate(
                self.encode(problem.prompt), n=1, max_tokens=self.cfg.algo.max_new_tokens,
                temperature=0.0, seed=0, stop_token_ids=[self.eos_id])
            text = self.decode([t for t in c.token_ids if t != self.eos_id])
            reward = self._reward(text, problem.answer)
            return problem.level, 0.0 if reward is None else reward

        try:
            results = await asyncio.gather(*(one(p) for p in self.eval_set))
        except ServerError:
            if not await self._lost(self.rollouts.index(rollout)):
                raise
            self.book.counts["evals_lost"] += 1   # the rollout failed under it
            return
        by_level: dict[int, list[float]] = {}
        for level, r in results:
            by_level.setdefault(level, []).append(r)
        record = {"accuracy": float(np.mean([r for _, r in results])),
                  **{f"accuracy_level{k}": float(np.mean(v)) for k, v in sorted(by_level.items())},
                  "trained_tokens": self.book.trained_tokens,
                  "wall_s": time.perf_counter() - self._t0}
        self.writer.write("eval", version, record)
        self.book.last_eval = {"version": version, **record}
        self.book.evaluated_versions.append(version)
        self.book.time["eval_s"] += time.perf_counter() - t0
        self._bar.write(f"eval @ version {version}: held-out accuracy {100 * record['accuracy']:.1f}%")
        self.wake.set()

    # --- train ----------------------------------------------------------------------

    async def _train(self, cmd: Consume, batch) -> None:
        b = self.book
        groups = tuple(x.group for x in batch)
        if cmd.version != b.trainer_version:
            raise StalenessViolation(f"Consume names version {cmd.version} but the trainer "
                                     f"is at {b.trainer_version}")
        eta = self.cfg.coord.eta
        for g in groups:
            # The bound, on every consumed token: V_token + η ≥ V_buf (StaleFlow §4.2).
            if g.version + eta < cmd.version:
                raise StalenessViolation(f"group {g.problem.uid} has a token of version "
                                         f"{g.version}, too old for buffer {cmd.version} (η={eta})")
        arrays, stats = make_batch(groups, b.trainer_version, algo=self.cfg.algo,
                                   trainer=self.cfg.trainer, seq_len=self.seq_len,
                                   pad_id=self.pad_id)
        header, t0 = await self._train_call(cmd.version, arrays)
        t1 = time.perf_counter()
        self._train_durations.append(t1 - t0)
        b.time["train_call_s"] += t1 - t0
        self._last_train_end = t1
        self.timeline.append({"t": t1 - self._t0, "event": "train", "t0": t0 - self._t0,
                              "version": cmd.version})
        for x in batch:
            recovery.log_consumed(self, x.group.problem.uid, cmd.version, x.group.trajectories)
        self.journal.write("trained", version=cmd.version)
        b.trainer_version = header["version"]
        b.steps_done += 1
        b.trained_tokens += stats["tokens"]
        b.counts["consumed_groups"] += len(groups)
        b.trainer_busy = False
        report.log_step(self, header["metrics"], {**stats, "staleness_bound_ok": True, "eta": eta})
        self.wake.set()

    async def _train_call(self, version: int, arrays) -> tuple[dict, float]:
        """Trains version → version + 1 on `arrays`. If the trainer fails during the step,
        waits for the supervisor to restart it from its newest checkpoint, then sends the
        same batch again, unless that checkpoint already holds this step (the trainer
        died after saving it): the step is then taken as done, without its metrics."""
        sup = self.supervisor
        while True:
            generation = self.trainer_generation
            sup.train_started(version + 1)
            t0 = time.perf_counter()
            trainer = self.trainer
            try:
                header = await asyncio.to_thread(trainer.call, {"cmd": "train"}, arrays,
                                                 timeout_s=self.cfg.trainer_timeout_s)
                sup.train_returned()
                shape = tuple(sorted((k, v.shape) for k, v in arrays.items()))
                if shape not in self._batch_shapes:
                    self._batch_shapes.add(shape)
                    self._spawn(sup.warm_standby())
                return header, t0
            except wire.RoleError as err:
                sup.trainer_raised(err, trainer)
                self.book.counts["train_retries"] += 1
            while self.trainer_generation == generation:   # the supervisor restarts it
                await asyncio.sleep(0.05)
            restored = self._restored_version
            if restored == version + 1:
                self.book.counts["steps_recovered_from_checkpoint"] += 1
                sup.train_returned()
                return {"version": restored, "metrics": {"recovered_from_checkpoint": 1.0}}, t0
            if restored != version:
                raise StalenessViolation(f"the restarted trainer resumed at version {restored}, "
                                         f"but the batch in flight trains version {version}")
