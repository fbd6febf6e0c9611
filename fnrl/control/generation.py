"""The rollout side of `act`: streams, pulls and evaluations, each an asyncio task over
a RolloutHandle, and rewarding a group once all its members finished.

- Route: one streaming request per trajectory (n = 1); every token and log-prob goes
  to the partial response pool before it counts. A trajectory with tokens continues
  from them: prompt + streamed tokens are re-prefilled with the remaining budget, and
  its next tokens carry the version the rollout serves now.
- Interrupt / Migrate / Abort: cancel the stream (vLLM aborts a request whose client
  went away); a later Route of the same trajectory waits for that cancel to land.
- Pull: waits for the rollout's interrupted streams and evaluations, then loads the
  relay's newest weights; the rollout's version changes when it lands.
- Evaluate: the held-out record (greedy accuracy, pass@k, mean@k) of the version a
  rollout serves (`--eval.server rollout`; the default is a server of its own,
  fnrl.control.eval_lane).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from fnrl.config import RunConfig
from fnrl.control.book import Book, Services, TaskIO
from fnrl.control.episodes import EpisodeOutcome, stream_episode
from fnrl.control.eval_lane import record_eval, score_heldout
from fnrl.control.handles import RelayTierHandle, RolloutHandle, ServerError, ToolsHandle
from fnrl.control.replay_routes import complete_routes, record_routes, routes_request
from fnrl.control.trajectories import IN_TS, TrajectoryTable, Tracked
from fnrl.control.workload import forced_length
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.data.reward import checked_reward
from fnrl.policy.filtering import keep_group
from fnrl.policy.seeding import request_seed
from fnrl.types import Group, Trajectory

PULL_ATTEMPTS = 4
PULL_RELAY_TIMEOUT_S = 10.0   # a dead relay is retried on a survivor after this
LOST_WAIT_S = 1.0             # a dying server closes its sockets before its exit shows


class Progress(Protocol):
    """What generation tells the fault detector (fnrl.control.supervisor)."""

    def streamed(self, rid: int) -> None: ...

    def finished(self, rid: int) -> None: ...

    def failing(self, name: str) -> bool: ...


@dataclass
class RolloutState:
    handle: RolloutHandle
    version: int = 0
    kv_capacity: float = 1.0
    kv_prev: float = 0.0
    complete: int = 0                 # trajectories finished here since its last Pull
    tokens: int = 0                   # tokens sampled here, all told (the timeline's)
    waiting: int = 0                  # vLLM's waiting-queue length, from its heartbeat
    pull_task: asyncio.Task | None = None
    evals: set = field(default_factory=set)      # evaluation tasks running here
    streams: set = field(default_factory=set)    # stream tasks placed here, not done
    active_s: float = 0.0             # time with at least one trajectory placed
    blocked_s: float = 0.0            # time with nothing placed while the trainer was down
    down: bool = False                # failed; being restarted (no routing, no pulls)
    kv_token_s: float = 0.0           # ∫ KV in use dt, for the mean utilization


class Generation:
    def __init__(self, cfg: RunConfig, rollouts: list[RolloutHandle], relays: RelayTierHandle, *,
                 table: TrajectoryTable, pool: PartialResponsePool, journal, task: TaskIO,
                 book: Book, svc: Services, progress: Progress, writer, log=print,
                 tools: ToolsHandle | None = None):
        self.cfg, self.relays, self.table, self.pool, self.journal = cfg, relays, table, pool, journal
        self.task, self.book, self.svc, self.progress = task, book, svc, progress
        self.writer, self.log = writer, log
        self.rollouts = [RolloutState(h) for h in rollouts]
        # Multi-turn environments (fnrl.control.episodes): what runs their tools (a role
        # handle), and each finished episode's reward and tool facts, by trajectory uid.
        self.tools = tools
        if self.multi_turn and tools is None:
            raise ValueError(f"task.env={cfg.task.env!r} is multi-turn: its tool calls need a "
                             "runner (Roles.tools, e.g. fnrl.sandbox.pool.SandboxPool)")
        self.outcomes: dict[str, EpisodeOutcome] = {}

    @property
    def multi_turn(self) -> bool:
        return self.cfg.task.env != "math"

    @property
    def replay(self) -> bool:
        """Rollout routing replay: every request asks the engine for its routes."""
        return self.cfg.model.routing_replay == "replay"

    def _sampling(self, seed: int | None) -> dict:
        """A request's sampling settings (the behaviour policy's), with its seed."""
        algo = self.cfg.algo
        return dict(temperature=algo.temperature, top_p=algo.top_p, top_k=algo.top_k, seed=seed)

    async def start(self) -> None:
        """KV capacities, and one request per server first, so no server's first batch
        (lazy kernel set-up in the engine) lands inside the measured window."""
        if self.multi_turn:
            await self.tools.start()
        for r in self.rollouts:
            r.kv_capacity = float(self.cfg.rollout.kv_capacity_tokens
                                  or await r.handle.kv_capacity_tokens())
        probe = self.task.encode(self.task.eval_set[0].prompt)
        await asyncio.gather(*(r.handle.generate(probe, n=1, max_tokens=4, temperature=1.0, seed=0)
                               for r in self.rollouts))

    # --- placement (called by act) ------------------------------------------------------

    def fill(self, num_groups: int) -> None:
        """FillPrompts: the next `num_groups` problems become groups in the TS, journaled."""
        cfg, task = self.cfg, self.task
        for problem in task.prompts.take(num_groups):
            prompt_ids = tuple(task.encode(problem.prompt))
            base = len(self.table.trajs)
            room = task.seq_len - len(prompt_ids)   # vLLM: prompt + max_tokens ≤ max_model_len
            lens = [forced_length(cfg.rollout, cfg.seed, base + k) for k in range(cfg.algo.group_size)]
            lens = [None if n is None else min(n, room) for n in lens]
            rec = self.table.add_group(problem, prompt_ids, lens)
            self.journal.write("fill", problem=dataclasses.asdict(problem), lens=lens,
                               uids=[t.uid for t in self.table.members(rec.gid)])

    def place(self, t: Tracked, rid: int) -> None:
        assert t.live and t.inst == IN_TS, (t.tid, t.inst, rid)
        t.inst, t.started = rid, False
        t.placements += 1
        rollout = self.rollouts[rid]
        t.task = self.svc.spawn(self._stream(t, rid, prior=t.task, pull=rollout.pull_task,
                                             evals=list(rollout.evals)))
        rollout.streams.add(t.task)
        t.task.add_done_callback(rollout.streams.discard)

    def unplace(self, t: Tracked, rid: int) -> None:
        assert t.live and t.inst == rid, (t.tid, t.inst, rid)
        t.inst = IN_TS
        if t.task is not None:
            t.task.cancel()

    def route(self, tids, rid: int) -> None:
        for tid in tids:
            self.place(self.table.trajs[tid], rid)

    def interrupt(self, tids, rid: int) -> None:
        for tid in tids:
            self.unplace(self.table.trajs[tid], rid)

    def migrate(self, tids, src: int, dst: int) -> None:
        for tid in tids:
            self.unplace(self.table.trajs[tid], src)
            self.place(self.table.trajs[tid], dst)

    def abort(self, tids, rid: int | None) -> None:
        """Abort: the trajectories end where they are (on rollout `rid`, or in the TS),
        and their tokens leave the partial response pool."""
        for tid in tids:
            t = self.table.trajs[tid]
            if rid is not None:
                self.unplace(t, rid)
            t.aborted = True
            self.pool.drop(t.uid)

    def drop_groups(self, gids) -> None:
        self.journal.write("drop", groups=[self.table.groups[g].name for g in gids])
        self.table.drop(gids, event=False)

    def pull(self, rid: int) -> bool:
        """Starts a pull of the trainer's newest version; False if the rollout is down."""
        rollout = self.rollouts[rid]
        if rollout.down:
            return False
        rollout.complete = 0
        # Waits only for tasks issued before it (so no two tasks wait on each other).
        rollout.pull_task = self.svc.spawn(self._pull(rid, list(rollout.streams), list(rollout.evals),
                                                      self.book.trainer_version))
        return True

    def evaluate(self, rid: int) -> None:
        rollout = self.rollouts[rid]
        if rollout.down:
            return
        task = self.svc.spawn(self._evaluate(rid, after=rollout.pull_task))
        rollout.evals.add(task)
        task.add_done_callback(rollout.evals.discard)

    def rollout_down(self, rid: int) -> None:
        """Rollout `rid` failed: every trajectory on it goes back to the trajectory
        server, its streamed tokens kept in the pool."""
        rollout = self.rollouts[rid]
        rollout.down = True
        on = self.table.on(rid)
        for t in on:
            self.unplace(t, rid)
        rollout.complete, rollout.waiting = 0, 0
        self.book.counts["fault_interrupted"] += len(on)
        self.svc.wake()

    async def rollout_up(self, rid: int) -> None:
        """A restarted rollout loads the newest weights, then takes work again."""
        rollout = self.rollouts[rid]
        rollout.version = await rollout.handle.pull(self.relays.address_for(rid),
                                                    min_version=self.book.trainer_version)
        rollout.down = False

    # --- the tasks ------------------------------------------------------------------------

    async def lost(self, rid: int) -> bool:
        """Whether rollout `rid` failed (known, being killed, or its process is gone), so
        that an I/O error on it is the failure's and the supervisor moves its work."""
        rollout = self.rollouts[rid]
        for _ in range(int(LOST_WAIT_S / 0.05) + 1):
            if rollout.down or self.progress.failing(rollout.handle.name) \
                    or rollout.handle.exit_code() is not None:
                return True
            await self.svc.clock.sleep(0.05)
        return False

    async def _stream(self, t: Tracked, rid: int, *, prior, pull, evals) -> None:
        try:
            for waited in (prior and [prior], pull and [pull], evals):
                if waited:   # its last interrupt, a Pull before it, evaluations: landed
                    await asyncio.wait(waited)
            await self._stream_once(t, rid)
        except ServerError:
            if not await self.lost(rid):
                raise
            # The rollout died under it: the trajectory stays placed until the supervisor
            # moves it back to the TS with what was streamed.

    async def _stream_once(self, t: Tracked, rid: int) -> None:
        if self.multi_turn:
            await self._episode_once(t, rid)
            return
        rollout, cfg, book = self.rollouts[rid], self.cfg, self.book
        if t.uid not in self.pool:
            self.pool.start(t.uid, t.prompt_ids)
        streamed = tuple(tok for s in self.pool.get(t.uid).segments for tok in s.token_ids)
        budget = (t.target_len or cfg.algo.max_new_tokens) - len(streamed)
        if streamed:
            book.counts["reprefill_tokens"] += len(t.prompt_ids) + len(streamed)
            book.counts["continued"] += 1
        version, reason = rollout.version, "length"
        if budget > 0:
            forced = t.target_len is not None
            # Seeded by what names the work, not by arrival (fnrl.policy.seeding).
            seed = request_seed(cfg.seed, t.uid, len(streamed)) if cfg.deterministic else None
            stream = rollout.handle.generate_stream(
                t.prompt_ids + streamed, max_tokens=budget, temperature=cfg.algo.temperature,
                top_p=cfg.algo.top_p, top_k=cfg.algo.top_k, seed=seed, stop_token_ids=() if forced else self.task.stop_ids,
                ignore_eos=forced, request_id=f"{t.uid}#{t.placements}",
                **routes_request(self.pool, t.uid, self.replay))
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if chunk.token_ids:
                        # Durable before it counts: an interrupt or crash keeps it.
                        self.pool.append(t.uid, version, chunk.token_ids, chunk.logprobs)
                        t.tokens += len(chunk.token_ids)
                        t.started = True
                        book.generated_tokens += len(chunk.token_ids)
                        rollout.tokens += len(chunk.token_ids)
                        self.progress.streamed(rid)
                    record_routes(self.pool, t.uid, chunk)
                    if chunk.finish_reason is not None:
                        reason = chunk.finish_reason
                        break
        if self.replay:
            book.counts["routes_requests"] += await complete_routes(
                self.pool, t.uid, rollout.handle, request_id=f"{t.uid}#{t.placements}",
                sampling=self._sampling(seed))
        self.pool.finish(t.uid, reason)
        t.finished = True
        rollout.complete += 1
        self.progress.finished(rid)
        self.reward_group(t.gid)
        self.svc.wake()

    async def _episode_once(self, t: Tracked, rid: int) -> None:
        """One environment episode for `t` (fnrl.control.episodes); an episode cut off
        before resumes from what the pool holds of it (or runs afresh when its
        environment cannot be restored)."""
        rollout, cfg, book = self.rollouts[rid], self.cfg, self.book
        before = self.pool.get(t.uid) if t.uid in self.pool else None
        t.tokens = 0

        def on_resumed(n: int) -> None:   # sampled tokens a cut-off placement left
            t.tokens = n

        def on_tokens(n: int) -> None:
            t.tokens += n
            t.started = True
            book.generated_tokens += n
            rollout.tokens += n
            self.progress.streamed(rid)

        seed = request_seed(cfg.seed, t.uid, 0) if cfg.deterministic else None
        outcome = await stream_episode(
            env_name=cfg.task.env, runner=self.tools, problem=self.table.groups[t.gid].problem,
            prompt_ids=t.prompt_ids, uid=t.uid, pool=self.pool, handle=rollout.handle,
            version=lambda: rollout.version, encode_text=self.task.encode_text,
            decode=self.task.decode, stop_ids=self.task.stop_ids,
            max_new_tokens=cfg.algo.max_new_tokens,
            sampling=self._sampling(seed),
            request_id=f"{t.uid}#{t.placements}", on_tokens=on_tokens, on_resumed=on_resumed,
            on_env_error=self._env_error, replay=self.replay)
        if before is not None and before.segments:
            book.counts["episodes_resumed" if outcome.resumed else "episodes_restarted"] += 1
        self.outcomes[t.uid] = outcome
        # The grade goes with the finish record: a restarted controller rewards the
        # episode as its environment did.
        self.pool.finish(t.uid, outcome.finish_reason, outcome=dataclasses.asdict(outcome))
        t.finished = True
        rollout.complete += 1
        self.progress.finished(rid)
        self.reward_group(t.gid)
        self.svc.wake()

    def _env_error(self, err: Exception) -> None:
        self.book.counts["env_errors"] += 1
        if self.book.counts["env_errors"] <= 3:
            self.log(f"{err} (the episode is tried again from scratch, then its group "
                     "is dropped)")

    async def close_tools(self) -> None:
        """Stops the sandbox's workers (multi-turn runs)."""
        if self.multi_turn:
            await self.tools.close()

    def reward(self, ids, gold: str) -> float | None:
        """The verifier's reward of a response's token ids, or None (the trajectory is
        invalid, and counted) when it raises or returns something non-finite: one bad
        answer never ends the job."""
        text = self.task.response_text(ids)
        try:
            return checked_reward(self.task.reward_fn(text, gold, len(ids)))
        except Exception as err:  # noqa: BLE001 - any verifier failure marks the sample
            self.book.counts["reward_errors"] += 1
            if self.book.counts["reward_errors"] <= 3:
                self.log(f"reward function raised on {text!r}: {type(err).__name__}: {err}")
            return None

    def reward_group(self, gid: int) -> None:
        """Rewards a group whose members have all finished; the data-path filter
        (fnrl.policy.filtering) decides whether it is kept for training."""
        rec = self.table.groups[gid]
        members = self.table.members(gid)
        if not all(m.finished for m in members) or rec.dropped or rec.group is not None:
            return
        trajs = []
        for m in members:
            item = self.pool.get(m.uid)
            ids = [tok for s in item.segments for tok in s.token_ids]
            outcome = self.outcomes.pop(m.uid, None)
            if outcome is None and item.outcome is not None:   # rewarded after a restart
                outcome = EpisodeOutcome(**item.outcome)
            if outcome is not None:   # a multi-turn episode: its environment graded it
                reward = None if outcome.reward is None else checked_reward(outcome.reward)
            else:
                reward = self.reward(ids, rec.problem.answer)
            self.book.invalid_trajectories += reward is None
            trajs.append(Trajectory(uid=m.uid, prompt_ids=item.prompt_ids, segments=item.segments,
                                    routes=item.trajectory_routes(),
                                    finish_reason=item.finish_reason, reward=reward,
                                    tool_calls=outcome.tool_calls if outcome else 0,
                                    tool_ok=outcome.tool_ok if outcome else 0))
        failed = [m.uid for m, t in zip(members, trajs) if t.finish_reason == "env_error"]
        if failed:   # an environment failed twice: the group is dropped, and counted
            self.journal.write("drop", groups=[rec.name], env_failed=failed)
            self.book.counts["env_failed_groups"] += 1
            self.table.reward(gid, Group(rec.problem, tuple(trajs)), keep=False)
            return
        keep = keep_group([t.reward for t in trajs], dynamic_sampling=self.cfg.algo.dynamic_sampling)
        if not keep:
            self.journal.write("drop", groups=[rec.name])
            self.book.counts["dynamic_sampling_dropped"] += 1
        self.table.reward(gid, Group(rec.problem, tuple(trajs)), keep=keep)

    async def _pull(self, rid: int, streams: list, evals: list, version: int) -> None:
        rollout = self.rollouts[rid]
        if streams:
            await asyncio.wait(streams)   # interrupted streams have closed
        if evals:
            await asyncio.wait(evals)     # an evaluation pins the version it started on
        t0 = self.svc.clock.now()
        for attempt in range(PULL_ATTEMPTS):
            try:
                # A live relay answers (and receives the version) within moments; a dead
                # one must not hold the engine, which does not generate during a pull.
                rollout.version = await rollout.handle.pull(
                    self.relays.address_for(rid), relay_timeout_s=PULL_RELAY_TIMEOUT_S,
                    min_version=version)
                break
            except ServerError:
                if await self.lost(rid):
                    rollout.pull_task = None   # it pulls the newest when it is back
                    return
                if attempt == PULL_ATTEMPTS - 1:
                    raise
                # Its relay died mid-pull: the tier splices it out within a heartbeat,
                # and `address_for` then names a survivor.
                self.book.counts["pull_retries"] += 1
                await self.svc.clock.sleep(0.5 * (attempt + 1))
        self.book.time["pull_s"] += self.svc.clock.now() - t0
        self.svc.event("pull", t0=t0, rid=rid, version=rollout.version)
        rollout.pull_task = None
        self.svc.wake()

    async def _evaluate(self, rid: int, *, after=None) -> None:
        """The held-out record (fnrl.control.eval_lane.score_heldout) of the version
        rollout `rid` serves (after a pull)."""
        if after is not None:
            await asyncio.wait([after])
        rollout = self.rollouts[rid]
        version, t0 = rollout.version, self.svc.clock.now()
        try:
            record = await score_heldout(rollout.handle.generate, self.task, self.cfg, self.reward,
                                         tools=self.tools)
        except ServerError:
            if not await self.lost(rid):
                raise
            self.book.counts["evals_lost"] += 1   # the rollout failed under it
            return
        record_eval(self.book, self.svc, self.writer, record, version=version, lane="rollout",
                    t0=t0, log=self.log)

    async def evaluate_now(self) -> None:
        """Evaluates the trainer's newest version on rollout 0, pulling it first."""
        if self.book.trainer_version in self.book.evaluated_versions:
            return
        rollout = self.rollouts[0]
        if rollout.pull_task is not None:
            await rollout.pull_task
        await asyncio.gather(*rollout.evals, return_exceptions=True)
        if rollout.version < self.book.trainer_version:
            rollout.version = await rollout.handle.pull(
                self.relays.address_for(0), min_version=self.book.trainer_version)
        await self._evaluate(0)

    async def stop_streams(self) -> None:
        """Stops generation at the end: what was streamed stays in the pool."""
        live = [t.task for t in self.table.trajs.values() if t.task is not None and not t.task.done()]
        for task in live:
            task.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        self.book.counts["unfinished_at_end"] = sum(t.live and t.tokens > 0
                                                    for t in self.table.trajs.values())
