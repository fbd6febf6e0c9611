"""Staleness with multi-turn trajectories (issue 14): a trajectory is one staleness unit
whose V is its oldest sampled token's version; fed turns (tool results) carry the
version of the sampled turn before them and never count; interrupts split a sampled
turn into segments of rising versions. Random trajectories of that shape, checked
against V_traj, the trainer's bound check, the batch statistics, the partial response
pool and the coordinator's version-driven decisions."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hst

from fnrl.config import AlgoConfig, CostModel, RoutingConfig, TrainerConfig
from fnrl.control.training import StalenessViolation, check_bound
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.envs.turns import FedTurn, SampledTurn, oldest_version
from fnrl.policy import staleness as st
from fnrl.policy.routing import WorkingView, plan_sync, route
from fnrl.trainer.batching import make_batch
from fnrl.types import ClusterSnapshot, Group, Problem, Segment, Trajectory

PROBLEM = Problem(uid="p", prompt="1+1", answer="2", level=1)
ALGO = AlgoConfig(group_size=2, groups_per_step=3, max_new_tokens=64, learning_rate=1e-2)


@hst.composite
def multiturn(draw, uid="t"):
    """(trajectory, sampled turns): 1-3 sampled turns with fed turns between them. A
    sampled turn is 1-3 segments of strictly rising versions (each later one resumed
    after an interrupt on a newer version); versions never fall from turn to turn; a
    fed turn carries the version of the sampled segment before it, log-probs 0."""
    ids = lambda n: tuple(draw(hst.lists(hst.integers(3, 40), min_size=n, max_size=n)))
    v, segs, turns = draw(hst.integers(0, 3)), [], draw(hst.integers(1, 3))
    for turn in range(turns):
        if turn:
            n = draw(hst.integers(1, 3))
            segs.append(Segment(v, ids(n), (0.0,) * n, fed=True))
            v += draw(hst.integers(0, 1))           # the next turn may run on a newer version
        for part in range(draw(hst.integers(1, 3))):
            v += part and draw(hst.integers(1, 2))  # interrupted mid-turn, resumed newer
            n = draw(hst.integers(1, 3))
            lps = draw(hst.lists(hst.floats(-8.0, -1e-3), min_size=n, max_size=n))
            segs.append(Segment(v, ids(n), tuple(lps)))
    prompt = ids(draw(hst.integers(1, 4)))
    return Trajectory(uid, prompt, tuple(segs), "stop",
                      reward=float(draw(hst.integers(0, 1)))), turns


def sampled_versions(tr: Trajectory) -> list[int]:
    """The reference: versions of the sampled tokens, one per token."""
    return [v for v, m in zip(tr.versions, tr.loss_mask) if m]


def single_turn(tr: Trajectory) -> Trajectory:
    """The same ids as one sampled turn: every fed version repeats a sampled one, so its
    sampled-token versions are the multi-turn trajectory's, and its length is the same."""
    return dataclasses.replace(tr, segments=tuple(dataclasses.replace(s, fed=False)
                                                  for s in tr.segments))


def without_fed(tr: Trajectory) -> Trajectory:
    return dataclasses.replace(tr, segments=tuple(s for s in tr.segments if not s.fed))


@settings(max_examples=200, deadline=None)
@given(mt=multiturn(), fed_v=hst.lists(hst.integers(-1, 9), min_size=3, max_size=3))
def test_version_is_the_oldest_sampled_token(mt, fed_v):
    """V_traj is the oldest sampled token's version, as `oldest_version` reads it from the
    turns; the turn structure is what the segments say; and a fed segment never moves
    V_traj, whatever version it carries (even an older one, or -1 as in FED_VERSION)."""
    tr, turns = mt
    as_turns = [FedTurn(token_ids=s.token_ids) if s.fed else
                SampledTurn(version=s.version, token_ids=s.token_ids, logprobs=s.logprobs)
                for s in tr.segments]
    assert tr.version == min(sampled_versions(tr)) == oldest_version(as_turns)
    assert tr.num_sampled_turns == turns
    assert len(tr.turn_starts) == 2 * turns - 1
    assert tr.loss_mask == tuple(int(not s.fed) for s in tr.segments for _ in s.token_ids)
    it = iter(fed_v)
    moved = dataclasses.replace(tr, segments=tuple(
        dataclasses.replace(s, version=next(it)) if s.fed else s for s in tr.segments))
    assert moved.version == without_fed(tr).version == tr.version


def test_version_ignores_a_leading_fed_turn_and_empty_segments():
    """The edge cases where the minimum over all segments differs: a fed turn before any
    sampled token (its sampled turn produced nothing) and an empty segment, both older."""
    tr = Trajectory("t", (1,), (Segment(0, (), ()), Segment(1, (5, 6), (0.0, 0.0), fed=True),
                                Segment(3, (7,), (-0.5,))), "stop", reward=1.0)
    assert tr.version == 3
    assert Trajectory("t", (1,), (Segment(2, (), ()),), "length").version == 2  # nothing sampled


def _groups(trs, size):
    return tuple(Group(PROBLEM, tuple(trs[i:i + size])) for i in range(0, len(trs), size))


@settings(max_examples=150, deadline=None)
@given(mts=hst.lists(multiturn(), min_size=1, max_size=6), eta=hst.integers(0, 3),
       ahead=hst.integers(0, 4), size=hst.integers(1, 3))
def test_check_bound_admits_iff_every_oldest_sampled_token_is_within_eta(mts, eta, ahead, size):
    """The trainer's bound check admits a batch iff V_traj + η ≥ V_buf for every member,
    V_traj being the oldest sampled token's version, and reports the largest staleness
    of a sampled token; it decides the same with the fed turns cut out."""
    trs = [tr for tr, _ in mts]
    v_buf = max(max(tr.versions) for tr in trs) + ahead
    admit = all(min(sampled_versions(tr)) + eta >= v_buf for tr in trs)
    for batch in (_groups(trs, size), _groups([without_fed(tr) for tr in trs], size)):
        if admit:
            _, worst = check_bound(batch, v_buf, eta)
            assert worst == v_buf - min(min(sampled_versions(tr)) for tr in trs)
        else:
            with pytest.raises(StalenessViolation):
                check_bound(batch, v_buf, eta)


@settings(max_examples=60, deadline=None)
@given(mts=hst.lists(multiturn(), min_size=2, max_size=5),
       ahead=hst.integers(0, 3), pack=hst.booleans())
def test_make_batch_counts_and_trains_only_sampled_tokens(mts, ahead, pack):
    """The batch's staleness histogram and maximum are over sampled tokens only, each
    token counted once; its loss mask over a trajectory's response is the trajectory's
    `loss_mask` (zero elsewhere) and fed positions carry log-prob 0; the episode
    statistics count sampled turns, not the segments interrupts make."""
    trs = [tr for tr, _ in mts]
    v_train = max(max(tr.versions) for tr in trs) + ahead
    trainer = TrainerConfig(pack_rows=len(trs)) if pack else TrainerConfig()
    arrays, stats = make_batch(_groups(trs, 2), v_train, algo=ALGO, trainer=trainer,
                               seq_len=64, pad_id=0, episodes=True)
    stale = [v_train - v for tr in trs for v in sampled_versions(tr)]
    assert stats["staleness_hist"] == [stale.count(k) for k in range(max(stale) + 1)]
    assert stats["staleness_max"] == v_train - min(tr.version for tr in trs)
    assert stats["tokens"] == len(stale) == arrays["mask_BxT"].sum()
    assert stats["turns_mean"] == pytest.approx(np.mean([turns for _, turns in mts]))
    assert stats["fed_tokens"] == sum(tr.loss_mask.count(0) for tr in trs)
    if not pack:   # one sequence per row, rows in batch order
        for row, tr in enumerate(trs):
            resp = slice(len(tr.prompt_ids) - 1, len(tr.prompt_ids) - 1 + len(tr.response_ids))
            mask = arrays["mask_BxT"][row]
            assert mask[resp].tolist() == list(tr.loss_mask)
            assert mask.sum() == sum(tr.loss_mask)
            assert arrays["target_BxT"][row, resp].tolist() == list(tr.response_ids)
            fed = np.asarray(tr.loss_mask) == 0
            assert (arrays["behaviour_logp_BxT"][row, resp][fed] == 0).all()


@settings(max_examples=40, deadline=None)
@given(mts=hst.lists(multiturn(), min_size=1, max_size=3), data=hst.data(),
       compact=hst.booleans())
def test_partial_pool_round_trips_multiturn(tmp_path_factory, mts, data, compact):
    """Whatever the chunking and the interleaving of trajectories, the pool rebuilds each
    trajectory's segments exactly (a fed turn never merges into the sampled segment of
    the same version before it), through a reopen and a compaction, so the loss mask
    and V_traj come back too, with each environment step's info."""
    path = tmp_path_factory.mktemp("pool") / "pool.log"
    trs = [dataclasses.replace(tr, uid=str(i)) for i, (tr, _) in enumerate(mts)]
    writes = []   # (uid, segment piece), each trajectory's pieces in order
    for tr in trs:
        pieces = []
        for s in tr.segments:
            # Sampled turns stream in chunks; an observation is fed whole, after its step.
            cuts = sorted(data.draw(hst.sets(hst.integers(1, len(s.token_ids) - 1), max_size=2))
                          if len(s.token_ids) > 1 and not s.fed else [])
            for a, b in zip([0, *cuts], [*cuts, len(s.token_ids)]):
                pieces.append((tr.uid, Segment(s.version, s.token_ids[a:b], s.logprobs[a:b],
                                               s.fed)))
        writes.append(pieces)
    order = data.draw(hst.permutations([i for i, p in enumerate(writes) for _ in p]))
    with PartialResponsePool(path) as pool:
        for tr in trs:
            pool.start(tr.uid, tr.prompt_ids)
        pool.start("gone", [1])
        pool.append("gone", 0, [2], [-1.0])
        for i in order:
            uid, s = writes[i].pop(0)
            if s.fed:
                pool.env_step(uid, {"reasons": ["ok"], "at": len(pool.get(uid).segments)})
            pool.append(uid, s.version, s.token_ids, s.logprobs, fed=s.fed)
        pool.drop("gone")
        if compact:
            pool.compact()
    with PartialResponsePool(path) as pool:
        assert pool.live() == tuple(tr.uid for tr in trs)
        for tr in trs:
            item = pool.get(tr.uid)
            back = Trajectory(tr.uid, item.prompt_ids, item.segments, "stop")
            assert item.prompt_ids == tr.prompt_ids and item.segments == tr.segments
            assert back.loss_mask == tr.loss_mask and back.version == tr.version
            # One environment step per fed turn, in order, for a resumed episode.
            fed_at = [k for k, seg in enumerate(tr.segments) if seg.fed]
            assert [st["at"] for st in item.env_steps] == fed_at


def _decisions(tr, state, inst_versions, ps_version):
    """What the coordinator decides for `tr`'s group: admission (and where it lands),
    then, waiting in the TS with its context, routing and the lazy sync."""
    if not st.can_reserve(state, tr.version):
        return st.window(state, tr.version), None
    state = st.reserve(state, 0, tr.version)
    R = len(inst_versions)
    snap = ClusterSnapshot(
        now_s=0.0, ps_version=ps_version, trainer_idle=False,
        inst_version_R=np.asarray(inst_versions, np.int64), inst_kv_used_R=np.zeros(R),
        inst_kv_prev_R=np.zeros(R), inst_kv_capacity_R=np.full(R, 1000.0),
        inst_num_complete_R=np.zeros(R, np.int64), traj_id_N=np.array([7]),
        traj_gid_N=np.array([0]), traj_inst_N=np.array([-1]), traj_waiting_N=np.array([False]),
        traj_len_N=np.array([len(tr.prompt_ids) + len(tr.response_ids)]))
    cost, empties = CostModel(k1=0.01, k2=1.0, k3=0.0, k4=0.0), st.empty_counts(state)
    plan = route(WorkingView(snap, st.group_versions(state), cost), state, list(empties), 0.3)
    sync = plan_sync(WorkingView(snap, st.group_versions(state), cost), state, empties,
                     RoutingConfig(), ps_version)
    return state, plan.routes, sync


@settings(max_examples=150, deadline=None)
@given(mt=multiturn(), eta=hst.integers(0, 2), batch=hst.integers(1, 3),
       ahead=hst.integers(0, 3), others=hst.lists(hst.integers(0, 3), max_size=6),
       behind=hst.lists(hst.integers(0, 4), min_size=1, max_size=3))
def test_policy_decides_by_oldest_sampled_version_alone(mt, eta, batch, ahead, others, behind):
    """Admission, routing (which rollouts may continue it) and the lazy sync decide the
    same for a multi-turn trajectory, for the single-turn one with the same ids and
    sampled-token versions, and for a group whose V is the oldest sampled version
    computed from the tokens: the policy sees V and the context length, never turns."""
    tr, _ = mt
    v_train = max(tr.versions) + ahead
    state = st.init_staleness(st.StalenessConfig(eta=eta, batch_size=batch), v_train)
    for gid, back in enumerate(others, start=1):   # other groups fill some entries
        if st.can_reserve(state, v_train - back):
            state = st.reserve(state, gid, v_train - back)
    inst = [max(0, v_train - b) for b in behind]   # rollouts behind, at or past V_traj
    ref = Trajectory(tr.uid, tr.prompt_ids, (Segment(min(sampled_versions(tr)),
                                                     tr.response_ids, tr.logprobs),), "stop")
    got = [_decisions(t, state, inst, v_train) for t in (tr, single_turn(tr), ref)]
    assert got[0] == got[1] == got[2]
