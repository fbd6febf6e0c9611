"""The controller loop: observe → decide → act, and nothing else changes the job.

`observe` freezes the controller's bookkeeping into a Snapshot, `decide` (pure, in
fnrl.policy.schedule) returns commands, and `act` starts one asyncio task per
command. Tasks report back by updating the bookkeeping when they finish; the loop
wakes on every completion and on a short tick that checks every role is alive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tqdm import tqdm

from fnrl.config import RunConfig
from fnrl.control import wire
from fnrl.control.metrics import MetricsWriter
from fnrl.control.roles import Cluster
from fnrl.data.arith import Problem, PromptStream
from fnrl.data.reward import checked_reward
from fnrl.losses.core import ADVANTAGES
from fnrl.policy.schedule import SchedulePlan, decide, select_batch
from fnrl.serving.client import RolloutClient
from fnrl.trainer.step import pack_sequences, scatter_response
from fnrl.types import (Evaluate, Generate, Group, Pull, RolloutView, Segment, Snapshot, Train,
                        Trajectory)


@dataclass
class RolloutState:
    client: RolloutClient
    version: int = 0
    busy: bool = False
    busy_s: float = 0.0


@dataclass
class Bookkeeping:
    """Mutable controller state, touched only by the loop and its tasks (one thread)."""

    trainer_version: int
    steps_done: int
    trainer_busy: bool = False
    ready: list[Group] = field(default_factory=list)
    inflight_groups: int = 0
    dropped_stale: int = 0
    invalid_trajectories: int = 0
    generated_tokens: int = 0
    trained_tokens: int = 0
    time: Counter = field(default_factory=Counter)
    last_eval: dict | None = None
    evaluated_versions: list[int] = field(default_factory=list)


class Controller:
    """Drives one run. Role processes are started and stopped by the caller."""

    def __init__(self, cfg: RunConfig, *, cluster: Cluster, trainer: wire.RoleClient,
                 relay_address: str, rollouts: list[RolloutClient], prompts: PromptStream,
                 eval_set: list[Problem], encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], reward_fn: Callable[[str, str], float],
                 eos_id: int, pad_id: int, seq_len: int, writer: MetricsWriter,
                 trainer_version: int):
        self.cfg, self.cluster = cfg, cluster
        self.relay_address = relay_address
        self.rollouts = [RolloutState(c) for c in rollouts]
        self.prompts, self.eval_set = prompts, eval_set
        self.encode, self.decode, self.reward_fn = encode, decode, reward_fn
        self.eos_id, self.pad_id, self.seq_len = eos_id, pad_id, seq_len
        self.writer = writer
        self.book = Bookkeeping(trainer_version=trainer_version, steps_done=trainer_version)
        self.trainer = trainer
        self.plan = SchedulePlan(
            mode=cfg.mode, total_steps=cfg.steps, groups_per_step=cfg.algo.groups_per_step,
            groups_per_rollout_batch=cfg.rollout.groups_per_batch,
            next_eval_version=trainer_version,
            max_ready_groups=2 * cfg.algo.groups_per_step)
        self._t0 = time.perf_counter()
        self._last_step_t = self._t0

    # --- observe ------------------------------------------------------------------

    def observe(self) -> Snapshot:
        b = self.book
        return Snapshot(
            rollouts=tuple(RolloutView(i, r.version, r.busy) for i, r in enumerate(self.rollouts)),
            trainer_version=b.trainer_version, trainer_busy=b.trainer_busy,
            ready_groups=len(b.ready), inflight_groups=b.inflight_groups,
            steps_done=b.steps_done)

    def finished(self, snap: Snapshot) -> bool:
        idle = not snap.trainer_busy and not any(r.busy for r in snap.rollouts)
        return (idle and snap.steps_done >= self.cfg.steps
                and snap.trainer_version in self.book.evaluated_versions)

    # --- the loop -----------------------------------------------------------------

    async def run(self) -> dict:
        tasks: set[asyncio.Task] = set()
        bar = tqdm(total=self.cfg.steps, initial=self.book.steps_done, desc="rl", unit="step",
                   dynamic_ncols=True)
        self._bar = bar
        try:
            while True:
                self.cluster.check()
                snap = self.observe()
                if self.finished(snap):
                    break
                if snap.steps_done >= self.cfg.steps and snap.trainer_version not in \
                        self.book.evaluated_versions:
                    # Always evaluate the final version, whatever eval_every says.
                    self.plan = dataclasses.replace(self.plan, next_eval_version=min(
                        self.plan.next_eval_version, snap.trainer_version))
                for cmd in decide(snap, self.plan):
                    tasks.add(asyncio.create_task(self.act(cmd)))
                if not tasks:
                    raise RuntimeError(f"scheduler stalled: nothing running and nothing to do "
                                       f"in {snap}")
                done, tasks = await asyncio.wait(tasks, timeout=0.5,
                                                 return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # re-raises a task's failure here, in the loop
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        return self.summary()

    # --- act ----------------------------------------------------------------------

    async def act(self, cmd) -> None:
        """Marks the target busy at once (so the next observe sees it), then runs it."""
        if isinstance(cmd, Train):
            self.book.trainer_busy = True
            await self._train(cmd.num_groups)
            self.book.trainer_busy = False
            return
        rollout = self.rollouts[cmd.rid]
        rollout.busy = True
        t0 = time.perf_counter()
        if isinstance(cmd, Pull):
            rollout.version = await rollout.client.pull(self.relay_address)
            self.book.time["pull_s"] += time.perf_counter() - t0
        elif isinstance(cmd, Generate):
            await self._generate(rollout, cmd.num_groups)
            self.book.time["generate_s"] += time.perf_counter() - t0
        elif isinstance(cmd, Evaluate):
            self.plan = dataclasses.replace(self.plan,
                                            next_eval_version=cmd.version + self.cfg.eval_every)
            await self._evaluate(rollout, cmd.version)
            self.book.time["eval_s"] += time.perf_counter() - t0
        rollout.busy = False
        rollout.busy_s += time.perf_counter() - t0

    async def _generate(self, rollout: RolloutState, num_groups: int) -> None:
        problems = self.prompts.take(num_groups)
        self.book.inflight_groups += num_groups
        version = rollout.version

        async def one_group(problem: Problem) -> None:
            prompt_ids = self.encode(problem.prompt)
            completions = await rollout.client.generate(
                prompt_ids, n=self.cfg.algo.group_size, max_tokens=self.cfg.algo.max_new_tokens,
                temperature=self.cfg.algo.temperature, seed=None, stop_token_ids=[self.eos_id])
            trajs = []
            for k, c in enumerate(completions):
                text = self.decode([t for t in c.token_ids if t != self.eos_id])
                reward = checked_reward(self.reward_fn(text, problem.answer))
                self.book.invalid_trajectories += reward is None
                self.book.generated_tokens += len(c.token_ids)
                trajs.append(Trajectory(
                    uid=f"{problem.uid}/{k}", prompt_ids=tuple(prompt_ids),
                    segments=(Segment(version, tuple(c.token_ids), tuple(c.logprobs)),),
                    finish_reason=c.finish_reason, reward=reward))
            self.book.ready.append(Group(problem, tuple(trajs)))
            self.book.inflight_groups -= 1

        await asyncio.gather(*(one_group(p) for p in problems))

    async def _evaluate(self, rollout: RolloutState, version: int) -> None:
        async def one(problem: Problem) -> tuple[int, float]:
            (c,) = await rollout.client.generate(
                self.encode(problem.prompt), n=1, max_tokens=self.cfg.algo.max_new_tokens,
                temperature=0.0, seed=0, stop_token_ids=[self.eos_id])
            text = self.decode([t for t in c.token_ids if t != self.eos_id])
            return problem.level, self.reward_fn(text, problem.answer)

        results = await asyncio.gather(*(one(p) for p in self.eval_set))
        by_level: dict[int, list[float]] = {}
        for level, r in results:
            by_level.setdefault(level, []).append(r)
        record = {"accuracy": float(np.mean([r for _, r in results])),
                  **{f"accuracy_level{k}": float(np.mean(v)) for k, v in sorted(by_level.items())},
                  "wall_s": time.perf_counter() - self._t0}
        self.writer.write("eval", version, record)
        self.book.last_eval = {"version": version, **record}
        self.book.evaluated_versions.append(version)
        self._bar.write(f"eval @ version {version}: held-out accuracy {100 * record['accuracy']:.1f}%")

    async def _train(self, num_groups: int) -> None:
        b = self.book
        batch, stale, rest = select_batch(b.ready, trainer_version=b.trainer_version,
                                          max_staleness=self.cfg.max_staleness,
                                          num_groups=num_groups)
        b.dropped_stale += sum(len(g.trajectories) for g in stale)
        if len(batch) < num_groups:  # staleness filtering left too few: wait for more
            b.ready = list(batch) + list(rest)
            return
        b.ready = list(rest)
        arrays, stats = self.make_batch(batch, b.trainer_version)
        t0 = time.perf_counter()
        header = await asyncio.to_thread(self.trainer.call, {"cmd": "train"}, arrays,
                                         timeout_s=self.cfg.trainer_timeout_s)
        b.time["train_call_s"] += time.perf_counter() - t0
        b.trainer_version = header["version"]
        b.steps_done += 1
        b.trained_tokens += stats["tokens"]
        self._log_step(header["metrics"], stats)

    def make_batch(self, groups: tuple[Group, ...], trainer_version: int):
        """Arrays for one train step, plus host-side statistics of what went in."""
        trajs = [t for g in groups for t in g.trajectories]
        rewards = np.array([[t.reward if t.reward is not None else np.nan
                             for t in g.trajectories] for g in groups], np.float32)
        valid = np.isfinite(rewards)
        adv = ADVANTAGES["grpo"](np.where(valid, rewards, 0.0), self.cfg.algo.adv_eps)
        adv = np.where(valid, adv, 0.0).reshape(-1)  # invalid trajectories get no gradient
        prompts = [t.prompt_ids for t in trajs]
        responses = [t.response_ids for t in trajs]
        arrays = pack_sequences(prompts, responses, self.seq_len, self.pad_id)
        plens = [len(p) for p in prompts]
        arrays["behaviour_logp_BxT"] = scatter_response([t.logprobs for t in trajs], plens,
                                                        self.seq_len)
        arrays["mask_BxT"] *= valid.reshape(-1)[:, None]
        arrays["adv_B"] = adv.astype(np.float32)
        versions = np.concatenate([np.asarray(t.versions, np.int64) for t in trajs])
        staleness = trainer_version - versions
        stats = {
            "reward_mean": float(np.nanmean(rewards)),
            "tokens": int(arrays["mask_BxT"].sum()),
            "staleness_mean": float(staleness.mean()),
            "staleness_max": int(staleness.max()),
            "staleness_hist": np.bincount(staleness, minlength=1).tolist(),
            "response_len_mean": float(np.mean([len(r) for r in responses])),
            "zero_variance_groups": int(np.sum(np.nanstd(rewards, axis=1) == 0)),
            "per_token_versions_ok": all(len(t.versions) == len(t.response_ids) for t in trajs),
        }
        return arrays, stats

    def _log_step(self, trainer_metrics: dict, stats: dict) -> None:
        b = self.book
        now = time.perf_counter()
        wall = now - self._t0
        record = {**{k: v for k, v in trainer_metrics.items()}, **stats,
                  "trained_tokens_per_s": stats["tokens"] / max(now - self._last_step_t, 1e-9),
                  "generated_tokens": b.generated_tokens, "dropped_stale": b.dropped_stale,
                  "invalid_trajectories": b.invalid_trajectories, "wall_s": wall,
                  **{f"time/{k}": v for k, v in b.time.items()},
                  "trainer_idle_frac": 1.0 - b.time["train_call_s"] / max(wall, 1e-9),
                  "rollout_busy_frac": float(np.mean([r.busy_s for r in self.rollouts])) / wall,
                  "rollout_versions": [r.version for r in self.rollouts]}
        self._last_step_t = now
        self.writer.write("train", b.trainer_version, record)
        acc = b.last_eval["accuracy"] if b.last_eval else float("nan")
        self._bar.set_postfix(reward=f"{stats['reward_mean']:.2f}", acc=f"{100 * acc:.0f}%",
                              stale=f"{stats['staleness_mean']:.2f}")
        self._bar.update(1)

    def summary(self) -> dict:
        return {"steps": self.book.steps_done, "version": self.book.trainer_version,
                "last_eval": self.book.last_eval, "dropped_stale": self.book.dropped_stale,
                "invalid_trajectories": self.book.invalid_trajectories,
                "wall_s": time.perf_counter() - self._t0}
