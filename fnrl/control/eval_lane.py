"""Held-out evaluation pinned to a version, on a server of its own.

The eval lane is one task beside the loop. When the trainer returns version v and v is
due (every `eval.every`-th version, see `next_due`), the evaluation server loads exactly
version v from the relay tier (`EvalServerHandle.pull_version`) and scores the held-out
set on it (`score_heldout`): greedy accuracy, pass@k and mean@k. Nothing waits for it:
the trainer goes on training, and the rollouts pull from the relays as before (no rollout
ever serves an evaluation, so none of their pulls waits on one). A version that falls
due while the lane is busy is evaluated when it is free if the relays still hold it
(their newest `relay.keep_versions`), else the newest is; a multiple of `eval.every`
passed over that way is counted (`evals_skipped`): a lane slower than `eval.every`
steps evaluates what it can rather than falling behind.

`score_heldout` is shared by the lane, by evaluation on a rollout
(`--eval.server rollout`, fnrl.control.generation) and by the stop-the-world
re-evaluation of a run's checkpoints (fnrl.experiments.evaluate), so a record means the
same thing wherever it was made.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from fnrl.config import RunConfig
from fnrl.control.book import Book, Services, TaskIO
from fnrl.control.handles import EvalServerHandle, RelayTierHandle, ServerError
from fnrl.data.eval_metrics import ProblemScore, eval_record, finite_or_zero, sample_seed
from fnrl.control.episodes import EnvError, GuardedEnv, env_kwargs
from fnrl.envs.base import InlineCalculator, ToolRunner
from fnrl.envs.episode import run_episode
from fnrl.envs.registry import make_env
from fnrl.envs.turns import SampledTurn

RewardFn = Callable[[Sequence[int], str], "float | None"]   # (response ids, gold) -> reward
PULL_TIMEOUT_S = 60.0   # the version is on the relays already when it falls due


def next_due(version: int, due: int, every: int, *, busy: bool,
             held: int = 1) -> tuple[int | None, int]:
    """Which version to evaluate now (None: none), and the next version due, when the
    trainer has just returned `version`. A due version is evaluated once the lane is
    free: the due one itself while the relays still hold it (one of their newest `held`),
    else the newest; the version after it that is due is the next multiple of `every`."""
    if busy or version < due:
        return None, due
    target = due if version - due < held else version
    return target, target - target % every + every


async def score_heldout(generate, task: TaskIO, cfg: RunConfig, reward: RewardFn, *,
                        tools: ToolRunner | None = None) -> dict:
    """The held-out record of the weights `generate` serves (without version or tokens):
    one greedy response per problem and `cfg.eval.samples` seeded samples at the run's
    sampling settings. `generate` is a handle's `generate` (RolloutHandle's signature).
    A multi-turn environment's problems are episodes, their tool calls run by `tools`
    (the run's sandbox; None: the calculator, inline)."""
    k, algo = cfg.eval.samples, cfg.algo
    stop = list(task.stop_ids)
    env_errors: list[str] = []   # held-out episodes whose environment failed: reward 0

    async def response_reward(prompt_ids, problem, *, temperature, seed, top_p=1.0,
                              top_k=-1) -> float:
        if cfg.task.env != "math":   # a multi-turn environment grades its own episode
            try:
                return finite_or_zero(await episode_reward(
                    generate, task, cfg, problem, prompt_ids, temperature=temperature,
                    seed=seed, top_p=top_p, top_k=top_k, tools=tools or InlineCalculator()))
            except EnvError as err:   # the environment's failure scores 0, counted
                env_errors.append(f"{problem.uid}: {err}")
                return 0.0
        (c,) = await generate(prompt_ids, n=1, max_tokens=algo.max_new_tokens,
                              temperature=temperature, seed=seed, stop_token_ids=stop,
                              top_p=top_p, top_k=top_k)
        return finite_or_zero(reward(c.token_ids, problem.answer))

    async def one(i: int, problem) -> ProblemScore:
        prompt_ids = task.encode(problem.prompt)
        greedy = response_reward(prompt_ids, problem, temperature=0.0, seed=0)
        sampled = [response_reward(prompt_ids, problem, temperature=algo.temperature,
                                   top_p=algo.top_p, top_k=algo.top_k,
                                   seed=sample_seed(cfg.eval.seed, i, j, k)) for j in range(k)]
        greedy_r, *sample_r = await asyncio.gather(greedy, *sampled)
        return ProblemScore(level=problem.level, greedy=greedy_r, samples=tuple(sample_r))

    scores = await asyncio.gather(*(one(i, p) for i, p in enumerate(task.eval_set)))
    record = eval_record(scores, k=k)
    if cfg.task.env != "math":
        record["env_errors"] = len(env_errors)
        record["env_error_examples"] = env_errors[:3]
    return record


async def episode_reward(generate, task: TaskIO, cfg: RunConfig, problem, prompt_ids, *,
                         temperature: float, seed: int | None, top_p: float = 1.0,
                         top_k: int = -1, tools: ToolRunner) -> float | None:
    """One held-out episode of the run's environment (`task.env`), its tools run by
    `tools`, each turn one request ending at the environment's stop strings: the reward
    it grades. The same turns, budget and stop strings as training
    (fnrl.control.episodes). The environment's failures are EnvErrors."""
    env = GuardedEnv(make_env(cfg.task.env, **env_kwargs(cfg.task.env, tools)), cfg.task.env)
    max_new = cfg.algo.max_new_tokens

    async def turn(context, stop_strings) -> SampledTurn:
        (c,) = await generate(context, n=1, max_tokens=max_new - (len(context) - len(prompt_ids)),
                              temperature=temperature,
                              seed=None if seed is None else seed + len(context),
                              stop_token_ids=list(task.stop_ids), top_p=top_p, top_k=top_k,
                              stop=stop_strings)
        lps = tuple(c.logprobs) if c.logprobs else (0.0,) * len(c.token_ids)
        return SampledTurn(version=0, token_ids=tuple(c.token_ids), logprobs=lps)

    try:
        episode = await run_episode(env, problem, generate=turn,
                                    encode_prompt=lambda _: prompt_ids,
                                    encode=env.guard(task.encode_text),
                                    decode=task.decode, max_context=len(prompt_ids) + max_new)
    finally:
        with contextlib.suppress(EnvError):
            await env.close()
    return episode.reward


def record_eval(book: Book, svc: Services, writer, record: dict, *, version: int, lane: str,
                t0: float, log) -> None:
    """Completes a scored record (version, trained tokens, lane, times), writes it and
    books it: shared by the lane and by evaluation on a rollout."""
    eval_s = svc.clock.now() - t0
    record.update(version=version, trained_tokens=book.tokens_at_version.get(version, 0),
                  lane=lane, eval_s=eval_s,
                  # 0 before the loop's clock starts (the first evaluation)
                  wall_s=svc.now() if svc.t0 else 0.0)
    writer.write("eval", version, record)
    book.last_eval = dict(record)
    book.evaluated_versions.append(version)
    book.time["eval_lane_s" if lane == "dedicated" else "eval_s"] += eval_s
    log(f"eval @ version {version} ({lane}): greedy {100 * record['accuracy']:.1f}%"
        + "".join(f", {key} {100 * record[key]:.1f}%" for key in record if key.startswith("pass@"))
        + f" in {eval_s:.1f}s")
    svc.wake()


class EvalLane:
    """The dedicated evaluation server's lane (see the module's docstring)."""

    def __init__(self, cfg: RunConfig, server: EvalServerHandle, relays: RelayTierHandle, *,
                 task: TaskIO, book: Book, svc: Services, writer, reward: RewardFn, log=print):
        self.cfg, self.server, self.relays, self.task = cfg, server, relays, task
        self.book, self.svc, self.writer, self.reward, self.log = book, svc, writer, reward, log
        self.due = book.trainer_version     # the version the run starts at is evaluated
        self.task_running: asyncio.Task | None = None
        self.lost = False                   # the server failed: the lane stops

    @property
    def busy(self) -> bool:
        return self.task_running is not None and not self.task_running.done()

    def version_trained(self, version: int) -> None:
        """The trainer returned `version` (published to the relays before it returned)."""
        if self.lost:
            return
        target, due = next_due(version, self.due, self.cfg.eval.every, busy=self.busy,
                               held=self.cfg.relay.keep_versions)
        if target is not None:
            # A version that fell due while the lane was busy is evaluated now if the
            # relays still hold it; the ones the relays retired meanwhile are passed over.
            self._passed_over(target)
            self.due = due
            self.task_running = self.svc.spawn(self._evaluate(target))

    def _passed_over(self, upto: int) -> None:
        """Counts the due versions below `upto` that will not be evaluated."""
        self.book.counts["evals_skipped"] += len(range(self.due, upto, self.cfg.eval.every))

    async def finish(self, version: int) -> None:
        """At the start and the end: the evaluation under way lands, then `version` is
        evaluated if it was not (outside the loop's measured wall either way)."""
        if self.task_running is not None:
            await asyncio.gather(self.task_running, return_exceptions=True)
        if not self.lost and version not in self.book.evaluated_versions:
            self._passed_over(version)   # due while the lane was busy, never evaluated
            await self._evaluate(version)
        self.due = max(self.due, version - version % self.cfg.eval.every + self.cfg.eval.every)

    async def _evaluate(self, version: int) -> None:
        t0 = self.svc.clock.now()
        try:
            served = await self.server.pull_version(self.relays.address_for(0), version,
                                                    relay_timeout_s=PULL_TIMEOUT_S)
            if served != version:
                raise ServerError(f"{self.server.name} serves version {served}, not {version}")
        except ServerError as err:
            if self._server_lost(err):
                return
            # The relays retired it before the lane got there (a live server): skipped.
            self.book.counts["evals_skipped"] += 1
            self.log(f"eval @ version {version} skipped: {err}")
            return
        try:
            record = await score_heldout(self.server.generate, self.task, self.cfg, self.reward)
        except ServerError as err:
            if self._server_lost(err):
                return
            raise
        record_eval(self.book, self.svc, self.writer, record, version=version,
                    lane="dedicated", t0=t0, log=self.log)

    def _server_lost(self, err: Exception) -> bool:
        """Whether the evaluation server died (the lane then stops; training goes on)."""
        if self.server.exit_code() is None:
            return False
        self.lost = True
        self.book.counts["evals_lost"] += 1
        self.log(f"eval server {self.server.exit_reason()}; held-out evaluation stops: {err}")
        return True
