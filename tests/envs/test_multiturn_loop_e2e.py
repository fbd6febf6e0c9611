"""Multi-turn episodes through the whole loop: real vLLM, relay, trainer and sandbox.

One job run proves three things (each job start costs tens of seconds, so they share
it). It uses the math task's warm-started model (worked arithmetic, not tool calls) and
puts, under the name "tool_arith" in the controller's registry (the trainer process
validates the name only), an environment whose turns end at each comma (the model's
worked lines read "2*34+0=68, r=8") and whose turns but the last call the calculator in
the real kernel sandbox, so episodes have several turns whatever the model knows of tools
(the embedded tokenizer's encoder drops whitespace, so the fed text has none). Each
training tool call first runs a hostile python call in the sandbox, and the run's first
tool call kills rollout0's vLLM server. The run then shows nothing of the attacks
outlived it, the cut-off episodes resumed with their earlier turns intact, and the
trainer trained on what vLLM sampled with the tool results masked, on the tool task's
own prompts ("tool-train-").

Not run end to end here: the real `--task.env tool_arith` environment (its <calc>
parsing) on the tool-call model the job warm-starts for it. A run of that on the 20-step
warm start wrote no tool call (one turn an episode), so it proved the job starts and
trains on that model, not its tool calls. Elsewhere: the tool warm start builds a model
that loads (tests/experiments/test_warm_start.py), the tool task's prompts reach the loop
(tests/envs/test_env_registry.py), the environment runs its calls in the sandbox
(tests/sandbox/test_hook_pool.py) and through the loop's episodes on fake servers
(tests/envs/test_loop_episodes.py); nothing trains the tool model through the real loop.
"""

import asyncio
import dataclasses
import json
import os
import signal
import time

from pathlib import Path

import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.control.metrics import read_jsonl
from fnrl.backends.roles import read_roles
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.sandbox.pool import SandboxPool
from fnrl.data.reward import math_reward
from fnrl.envs.base import ENVS, Step
from fnrl.experiments.math_grpo import main, parse_config
from fnrl.experiments.warm_start import ensure_default_model
from fnrl.trainer.batching import build_batch
from fnrl.types import Segment, Trajectory

pytestmark = pytest.mark.slow

SMALL = ["--warm-start.steps", "20", "--model.hidden-size", "64", "--model.intermediate-size",
         "128", "--model.num-hidden-layers", "2", "--model.num-attention-heads", "2",
         "--model.num-key-value-heads", "1", "--model.max-position-embeddings", "128",
         "--algo.max-new-tokens", "96", "--task.num-eval", "8", "--eval.every", "100",
         "--algo.groups-per-step", "4", "--rollout.queued-groups", "4"]
MAX_TURNS = 3


class CommaCalcEnv:
    """A turn ends at a comma; after each of the first MAX_TURNS-1 turns the sandbox's
    calculator evaluates the prompt's expression and its value is fed back."""

    tools = ()
    stop = (",",)

    def __init__(self, *, runner):
        self.runner = runner

    async def reset(self, problem):
        self.problem, self.turns, self.calls, self.ok, self.text = problem, 0, 0, 0, ""
        return problem.prompt

    async def step(self, action, *, num_tokens=0):
        self.turns += 1
        self.text += action
        if self.turns < MAX_TURNS and action.endswith(","):
            result = await self.runner.call("calculator",
                                            {"expression": self.problem.prompt.rstrip("=")})
            self.calls, self.ok = self.calls + 1, self.ok + result.ok
            return Step(observation=f"[{result.text}]", reward=None, done=False)
        return Step(observation="", done=True,
                    reward=float(math_reward(self.text, self.problem.answer)),
                    info={"tool_calls": self.calls, "tool_ok": self.ok})

    async def close(self):
        pass


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One warm-started model cache for every run."""
    return str(tmp_path_factory.mktemp("model_cache"))


@pytest.fixture(scope="module")
def arith_model(cache_dir):
    """`--model.model-dir` of the math task's warm-started model: the comma environments
    need its worked lines, where `--task.env tool_arith` alone would warm-start on tool
    calls."""
    cfg = parse_config(["--warm-start.cache-dir", cache_dir, *SMALL])
    model_dir = ensure_default_model(cfg.model, dataclasses.replace(cfg.task, env="math"),
                                     cfg.warm_start)
    return ["--model.model-dir", str(model_dir)]


def _read(path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:   # the process ended while listed
        return b""


def logged_trajectories(run_dir):
    out = {}
    for g in read_jsonl(run_dir / "trajectories.jsonl"):
        trajs = []
        for t in g["trajectories"]:
            fed = t.get("fed", [False] * len(t["segments"]))
            segs = tuple(Segment(v, tuple(ids), tuple(lps), f) for (v, _), ids, lps, f
                         in zip(t["segments"], t["token_ids"], t["logprobs"], fed))
            trajs.append(Trajectory(uid=t["uid"], prompt_ids=tuple(t["prompt_ids"]),
                                    segments=segs, finish_reason=t["finish_reason"],
                                    reward=t["reward"]))
        out.setdefault(g["consumed_version"], []).append(trajs)
    return out


def check_trained_on_the_sampled_ids_with_tool_results_masked(run_dir, steps: int):
    """Multi-turn episodes trained on the ids vLLM sampled, the tool results in their
    context but masked out of the loss (and logged with log-prob 0)."""
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert max(r["turns_mean"] for r in train) > 1.0
    assert all(r["tool_success_rate"] == 1.0 for r in train if r["tool_calls_mean"] > 0)
    # The trainer's log-probs of the sampled tokens, over sequences with tool results in
    # their context, are vLLM's: the context it trained on is the one vLLM was given.
    fresh = [r for r in train if r["staleness_max"] == 0]
    assert fresh and all(r["logp_abs_diff"] < 1e-2 for r in fresh)
    by_version = logged_trajectories(run_dir)
    multi = 0
    for r in train:
        groups = by_version[r["step"] - 1]
        trajs = [t for g in groups for t in g]
        sampled = sum(sum(t.loss_mask) for t in trajs if t.reward is not None)
        # The trainer's token count is the sampled tokens alone: no fed id was trained.
        assert r["tokens"] == sampled
        assert sum(r["staleness_hist"]) == r["tokens"]   # every trained token has a version
        assert r["fed_tokens"] == sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
        arrays, _ = build_batch(groups, algo=AlgoConfig(), trainer=TrainerConfig(),
                                seq_len=128, pad_id=0)
        for i, t in enumerate(t for g in groups for t in g):
            ids = np.asarray(t.prompt_ids + t.response_ids)
            n, p = len(ids) - 1, len(t.prompt_ids)
            assert (arrays["input_BxT"][i, :n] == ids[:-1]).all()
            assert (arrays["target_BxT"][i, :n] == ids[1:]).all()
            if t.reward is not None:
                assert (arrays["mask_BxT"][i, p - 1:n] == np.asarray(t.loss_mask)).all()
            for s in t.segments:
                if s.fed:   # a calculator result: never sampled, log-prob 0
                    assert s.logprobs == (0.0,) * len(s.logprobs)
            multi += len(t.turn_starts) > 1
    assert multi > 0


ATTACK = """
import _posixsubprocess, os, signal, sys
r, w = os.pipe()
args = [[sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'],
        [os.fsencode(sys.executable)], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w,
        True, True, -1, None, None, None, -1, None]
for attempt in (lambda: _posixsubprocess.fork_exec(*args, False),
                lambda: _posixsubprocess.fork_exec(*args),
                lambda: os.kill({controller}, signal.SIGKILL),
                lambda: os.mkfifo('/tmp/{marker}'),
                lambda: os.mkfifo('/dev/shm/{marker}'),
                lambda: open('{run_dir}/{marker}', 'w').write('x')):
    try:
        attempt()
    except BaseException:
        pass
'attacked'
"""


class CutCommaCalcEnv(CommaCalcEnv):
    """CommaCalcEnv whose every training tool call first runs a hostile python call in
    the sandbox (ATTACK: a process meant to outlive it, a SIGKILL to the controller, fifos
    in /tmp and /dev/shm, a file in the run dir; `results` keeps what each returned), and
    that a resumed episode can restore (each step's info keeps its action and its calls'
    outcomes). The first tool call of the run kills rollout0's vLLM server and then
    waits, like a slow tool, until the loop moves its trajectory off the dead rollout
    (cancelling the call); `cut` notes where the pool's log stood."""

    run_dir = None
    code = ""
    results: list = []
    cut: dict = {}
    finished: list = []   # training episodes done: the kill waits for two, so rollout0
    # has made progress (a rollout lost before its first trajectory restarts the job)

    async def step(self, action, *, num_tokens=0):
        # Training episodes' tools run in the sandbox; held-out ones inline (not cut).
        training = isinstance(self.runner, SandboxPool)
        calls = self.turns + 1 < MAX_TURNS and action.endswith(",")
        # The attack is part of the turn's tool call, so an episode in a step when the
        # rollout dies is one whose call runs again on resuming (a final turn's step
        # does not wait).
        if training and calls:
            self.results.append(await self.runner.call("python", {"code": self.code}))
        if training and calls and not self.cut and len(self.finished) >= 2:
            log = self.run_dir / "partial_responses.log"
            self.cut["pool_bytes"] = log.stat().st_size
            os.kill(int(read_roles(self.run_dir / "roles.json")["rollout0"]["pid"]),
                    signal.SIGKILL)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            raise RuntimeError("the loop never cut off the episode of a dead rollout")
        step = await super().step(action, num_tokens=num_tokens)
        if step.done:
            if training:
                self.finished.append(self.problem.uid)
            return step
        return dataclasses.replace(step, info={"action": action, "ok": self.ok})

    async def restore(self, problem, steps):
        self.problem, self.turns, self.calls = problem, len(steps), len(steps)
        self.text = "".join(s["action"] for s in steps)
        self.ok = steps[-1]["ok"] if steps else 0


def check_the_attacks_left_nothing_behind(run_dir, marker: str):
    """Every attack ran to its end in the kernel sandbox and none of it outlived the run:
    no process, no file outside the sandbox, the controller alive (this process)."""
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["sandbox"]["mode"] == "kernel", info["sandbox"]
    attacks = CutCommaCalcEnv.results
    assert attacks and all(r.reason == "ok" and "attacked" in r.text for r in attacks)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit()
            and marker.encode() in _read(p / "cmdline")]
    assert not left, "a process a tool call started outlived the run"
    escaped = [p for d in (Path("/tmp"), Path("/dev/shm"), run_dir) for p in d.glob(f"{marker}*")]
    assert not escaped, f"a tool call wrote outside its sandbox: {escaped}"


def check_the_cut_episodes_resumed_with_their_earlier_turns(run_dir, snapshot_log):
    """Every episode in flight when rollout0 died, the one waiting on its tool call
    included, is consumed once, beginning with exactly the ids (and log-probs) it had
    before the kill: its earlier turns are intact and its tool call ran again."""
    faults = read_jsonl(run_dir / "faults.jsonl")
    # The rollout alone was restarted (a role restart, not the job's).
    assert {"failure", "recovered"} <= {f["event"] for f in faults if f.get("role") == "rollout0"}
    assert all(a.get("job_restart") is not True for a in read_jsonl(run_dir / "attempts.jsonl"))
    # The pool as it stood at the kill: a copy of its log up to that point.
    snapshot_log.write_bytes((run_dir / "partial_responses.log").read_bytes()
                             [:CutCommaCalcEnv.cut["pool_bytes"]])
    with PartialResponsePool(snapshot_log) as snap:
        before = {uid: snap.get(uid) for uid in snap.live()}
    pending = [u for u, item in before.items() if item.turn_closed and item.finish_reason is None]
    assert pending, "the episode whose tool call was cut off is not in the pool"
    consumed = {}
    for g in read_jsonl(run_dir / "trajectories.jsonl"):
        for t in g["trajectories"]:
            assert t["uid"] not in consumed, f"{t['uid']} consumed twice"
            consumed[t["uid"]] = t
    assert set(pending) <= set(consumed), "a cut-off episode was never consumed"
    for uid, item in before.items():
        if uid not in consumed or not item.segments:
            continue
        t = consumed[uid]
        ids = [i for seg in t["token_ids"] for i in seg]
        lps = [x for seg in t["logprobs"] for x in seg]
        fed = t.get("fed", [False] * len(t["segments"]))
        mask = [0 if f else 1 for f, seg in zip(fed, t["token_ids"]) for _ in seg]
        kept = [i for s in item.segments for i in s.token_ids]
        assert ids[:len(kept)] == kept, f"{uid}: its turns before the kill changed"
        assert lps[:len(kept)] == [x for s in item.segments for x in s.logprobs]
        assert mask[:len(kept)] == [0 if s.fed else 1 for s in item.segments for _ in s.token_ids]
        if uid in pending:   # the call ran again: its result is fed right after the turn
            assert len(ids) > len(kept) and mask[len(kept)] == 0
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train[-1]["episodes_resumed"] >= len([u for u in pending if u in consumed])


def test_tool_calls_that_attack_and_a_rollout_killed_during_one_leave_the_run_whole(
        tmp_path, cache_dir, arith_model, monkeypatch):
    """One run, three things proven: every training tool call attacks from the sandbox
    and nothing of it outlives the run; the episodes in flight when rollout0 was killed
    during a tool call resume elsewhere with their earlier turns intact; and the run
    trained on the ids vLLM sampled with the tool results masked, resumed episodes
    included."""
    run_dir = tmp_path / "run"
    marker = f"fnrl-attack-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setattr(CutCommaCalcEnv, "run_dir", run_dir)
    monkeypatch.setattr(CutCommaCalcEnv, "code", ATTACK.format(
        marker=marker, controller=os.getpid(), run_dir=run_dir))
    monkeypatch.setattr(CutCommaCalcEnv, "results", [])
    monkeypatch.setattr(CutCommaCalcEnv, "cut", {})
    monkeypatch.setattr(CutCommaCalcEnv, "finished", [])
    monkeypatch.setitem(ENVS, "tool_arith", CutCommaCalcEnv)
    assert main(["--steps", "4", "--run-dir", str(run_dir), "--task.env", "tool_arith",
                 "--warm-start.cache-dir", cache_dir, *SMALL, *arith_model]) == 0
    assert CutCommaCalcEnv.cut, "no episode called its tool"
    check_the_attacks_left_nothing_behind(run_dir, marker)
    check_the_cut_episodes_resumed_with_their_earlier_turns(run_dir, tmp_path / "pool_at_kill.log")
    # The tool task's own prompts (fnrl.data.tool_arith) were trained on, not arith's.
    names = [g["group"] for g in read_jsonl(run_dir / "trajectories.jsonl")]
    assert names and all(n.startswith("tool-train-") for n in names)
    # The same run trained what every multi-turn run must, the resumed episodes included.
    check_trained_on_the_sampled_ids_with_tool_results_masked(run_dir, steps=4)
