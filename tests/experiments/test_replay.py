"""Replay from a run's records (fnrl.experiments.replay): the batches rebuilt from the
journal and trajectories.jsonl are the batches the controller sent, bit for bit."""

import dataclasses

import numpy as np
import pytest

from fnrl.config import AlgoConfig, RunConfig, TrainerConfig
from fnrl.control.journal import Journal
from fnrl.control.recovery import ConsumedLog
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.experiments.replay import ReplayError, Step, read_steps, rebuild_batch
from fnrl.trainer.batching import make_batch
from fnrl.trainer.controls import pack_controls
from fnrl.types import Group, Problem, Segment, Trajectory


def _group(k: int, rng: np.random.Generator, *, multi_turn: bool = False) -> Group:
    """`multi_turn`: sampled, fed (a tool result: mask 0, log-probs 0), sampled."""
    problem = Problem(uid=f"p{k}", prompt=f"{k}+1=", answer=str(k + 1), level=1)
    trajs = []
    for j in range(3):
        n1, n2 = rng.integers(1, 6, size=2)
        # Log-probs as vLLM sends them: doubles with every bit used.
        segs = (Segment(0, tuple(rng.integers(3, 20, n1).tolist()), tuple(-rng.random(n1))),
                Segment(0, tuple(rng.integers(3, 20, n2).tolist()), tuple(-rng.random(n2))))
        if multi_turn:
            segs = (segs[0], Segment(0, (7, 8, 9), (0.0, 0.0, 0.0), fed=True), segs[1])
        trajs.append(Trajectory(uid=f"p{k}/{j}", prompt_ids=(1, 4 + k, 5), segments=segs,
                                finish_reason="stop", reward=float(rng.integers(0, 2)),
                                tool_calls=int(multi_turn), tool_ok=int(multi_turn and j > 0)))
    return Group(problem, tuple(trajs))


def _write_run(run_dir, consumes):
    """Writes the records the controller writes: fill, then per consume (version,
    groups, trained?, controls) the journal lines and the groups' trajectories.jsonl."""
    pool = PartialResponsePool(run_dir / "partial_responses.log")
    journal = Journal(run_dir / "journal.jsonl")
    log = ConsumedLog(run_dir / "trajectories.jsonl", pool)
    for _, groups, _, _ in consumes:
        for g in groups:
            journal.write("fill", problem=dataclasses.asdict(g.problem),
                          uids=[t.uid for t in g.trajectories], lens=[None] * 3)
    for version, groups, trained, controls in consumes:
        journal.write("consume", version=version, groups=[g.problem.uid for g in groups])
        if trained:
            for g in groups:
                log.log(g.problem.uid, version, g.trajectories)
            journal.write("trained", version=version,
                          **({"controls": {k: v.item() for k, v in controls.items()}}
                             if controls else {}))
    log.close()
    journal.close()
    pool.close()


CFG = RunConfig(algo=AlgoConfig(group_size=3, groups_per_step=2),
                trainer=TrainerConfig(pack_rows=2, micro_batches=2))


@pytest.mark.parametrize("multi_turn", [False, True])
def test_rebuilt_batches_are_the_ones_sent(tmp_path, multi_turn):
    """Multi-turn: the fed segments come back fed (masked), with the tool facts."""
    rng = np.random.default_rng(0)
    g = [_group(k, rng, multi_turn=multi_turn) for k in range(6)]
    controls = pack_controls(lr_scale=0.5, upper={"grad_norm": 3.0}, lower={})
    consumes = [(0, (g[1], g[0]), True, {}),
                (1, (g[2], g[3]), True, controls),   # a skipped step: version 1 again
                (1, (g[5], g[4]), False, {}),        # sent, never returned (a crash)
                (1, (g[4], g[5]), True, {})]
    _write_run(tmp_path, consumes)
    steps = read_steps(tmp_path)
    assert [(s.version, [x.problem.uid for x in s.groups]) for s in steps] == [
        (0, ["p1", "p0"]), (1, ["p2", "p3"]), (1, ["p4", "p5"])]
    trained = [c for c in consumes if c[2]]
    for step, (version, groups, _, sent_controls) in zip(steps, trained):
        assert step.groups == groups   # every token, log-prob and reward, exactly
        want, _ = make_batch(groups, version, algo=CFG.algo, trainer=CFG.trainer,
                             seq_len=64, pad_id=0)
        want = {**want, **sent_controls}
        got = rebuild_batch(step, CFG, seq_len=64, pad_id=0)
        assert sorted(got) == sorted(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key


def test_a_group_without_rewards_cannot_be_replayed(tmp_path):
    # A recovery logs a group from the pool's items, which carry no reward.
    rng = np.random.default_rng(1)
    g = _group(0, rng)
    pool = PartialResponsePool(tmp_path / "partial_responses.log")
    for t in g.trajectories:
        pool.start(t.uid, t.prompt_ids)
        for s in t.segments:
            pool.append(t.uid, s.version, s.token_ids, s.logprobs)
        pool.finish(t.uid, "stop")
    journal = Journal(tmp_path / "journal.jsonl")
    journal.write("fill", problem=dataclasses.asdict(g.problem), uids=[], lens=[])
    journal.write("consume", version=0, groups=["p0"])
    log = ConsumedLog(tmp_path / "trajectories.jsonl", pool)
    log.log("p0", 0, [pool.get(t.uid) for t in g.trajectories], recovered=True)
    journal.write("trained", version=0)
    for f in (log, journal, pool):
        f.close()
    with pytest.raises(ReplayError, match="p0/0.*no reward"):
        read_steps(tmp_path)


def test_an_unknown_control_is_refused():
    step = Step(0, (_group(0, np.random.default_rng(2)),), {"lr_scale": 1.0})
    with pytest.raises(ReplayError, match="unknown control 'lr_scale'"):
        rebuild_batch(step, RunConfig(algo=AlgoConfig(group_size=3)), seq_len=64, pad_id=0)


def test_leaf_differences_are_bitwise():
    from fnrl.experiments.replay import leaf_differences

    a = {"w": np.array([1.0, np.nan], np.float32), "z": np.array([0.0], np.float32),
         "s": np.zeros((2,), np.float32)}
    assert leaf_differences(a, {k: v.copy() for k, v in a.items()}) == {
        "['s']": 0.0, "['w']": 0.0, "['z']": 0.0}   # NaN where NaN was: the same bits
    b = {"w": np.array([1.5, np.nan], np.float32), "z": np.array([-0.0], np.float32),
         "s": np.zeros((3,), np.float32)}
    assert leaf_differences(a, b) == {"['s']": np.inf, "['w']": 0.5, "['z']": np.inf}
