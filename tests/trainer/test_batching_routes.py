"""Routing replay in batch assembly: each input token's routes at its position in
`routes_BxTxLxK`, packed or not, and batches half with routes refused."""

import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.trainer.batching import build_batch, make_batch
from fnrl.types import Group, Problem, Routes, Segment, Trajectory

L, K = 2, 2
ALGO = AlgoConfig(group_size=3, groups_per_step=3, max_new_tokens=7, learning_rate=1e-2)


def route(sample: int, pos: int) -> tuple[tuple[int, ...], ...]:
    """A route that names its sample and position: 1000 * (sample + 1) + 10 * pos, plus
    its layer and rank (not real expert ids: batching copies them, never reads them)."""
    base = 1000 * (sample + 1) + 10 * pos
    return tuple(tuple(base + l * K + k for k in range(K)) for l in range(L))


def _groups(seed=0, with_routes=True):
    rng = np.random.default_rng(seed)
    groups, i = [], 0
    for g in range(3):
        prompt = tuple(int(t) for t in rng.integers(3, 20, rng.integers(2, 5)))
        trajs = []
        for _ in range(3):
            n = int(rng.integers(1, 8))
            ids = tuple(int(t) for t in rng.integers(3, 20, n))
            # Two segments (an interrupt and a continuation): routes span both.
            cut = n // 2
            segs = (Segment(0, ids[:cut], (-1.0,) * cut),
                    Segment(1, ids[cut:], (-1.0,) * (n - cut)))
            routes = Routes.of([route(i, p) for p in range(len(prompt) + n)])
            trajs.append(Trajectory(f"g{g}/{i}", prompt, segs, "stop", reward=float(i % 2),
                                    routes=routes if with_routes else None))
            i += 1
        groups.append(trajs)
    return groups


def _check_routes(routes_BxTxLxK, arrays, samples):
    """Every fed position holds the route of the token fed there, naming its sample and
    its position in the sequence; every input of every sample is there once."""
    fed = routes_BxTxLxK[..., 0, 0] > 0
    code = routes_BxTxLxK[..., 0, 0]
    sample_of, pos_of = code // 1000 - 1, (code % 1000) // 10
    if "positions_BxT" in arrays:
        np.testing.assert_array_equal(pos_of[fed], arrays["positions_BxT"][fed])
        np.testing.assert_array_equal(fed, arrays["segment_ids_BxT"] > 0)
    for row, t in zip(*np.nonzero(fed)):
        s = samples[sample_of[row, t]]
        assert (s.prompt_ids + s.response_ids)[pos_of[row, t]] == arrays["input_BxT"][row, t]
        np.testing.assert_array_equal(routes_BxTxLxK[row, t],
                                      route(sample_of[row, t], pos_of[row, t]))
    assert sorted(zip(sample_of[fed], pos_of[fed])) == [
        (i, p) for i, s in enumerate(samples)
        for p in range(len(s.prompt_ids) + len(s.response_ids) - 1)]


@pytest.mark.parametrize("trainer", [TrainerConfig(),
                                     TrainerConfig(pack_rows=3, length_buckets=(16, 32, 48)),
                                     TrainerConfig(pack_rows=4, micro_batches=2,
                                                   length_buckets=(16, 32, 48))],
                         ids=["unpacked", "packed", "packed-micro"])
def test_each_input_token_gets_its_own_routes(trainer):
    groups = _groups()
    samples = [s for g in groups for s in g]
    arrays, _ = build_batch(groups, algo=ALGO, trainer=trainer, seq_len=16, pad_id=0)
    got = arrays["routes_BxTxLxK"]
    assert got.dtype == np.int32 and got.shape == (*arrays["input_BxT"].shape, L, K)
    _check_routes(got, arrays, samples)


def test_routes_shifted_by_one_position_are_caught():
    """The check above fails on a layout that puts each token's routes one place late
    (routes of the targets instead of the inputs)."""
    groups = _groups()
    samples = [s for g in groups for s in g]
    arrays, _ = build_batch(groups, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    shifted = np.zeros_like(arrays["routes_BxTxLxK"])
    shifted[:, 1:] = arrays["routes_BxTxLxK"][:, :-1]
    with pytest.raises(AssertionError):
        _check_routes(shifted, arrays, samples)
    # Position 0 of row 0 is the first sample's first prompt token: route(0, 0), exactly.
    np.testing.assert_array_equal(arrays["routes_BxTxLxK"][0, 0], route(0, 0))


def test_without_routes_no_key_and_half_routed_is_refused():
    groups = _groups(with_routes=False)
    arrays, _ = build_batch(groups, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    assert "routes_BxTxLxK" not in arrays
    mixed = _groups()
    mixed[1][2] = _groups(with_routes=False)[1][2]
    with pytest.raises(ValueError, match=r"sample 5 \(uid 'g1/5'\) has no routes"):
        build_batch(mixed, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)


def test_make_batch_carries_routes():
    groups = [Group(Problem(f"p{g}", "q", "1", 1), tuple(t)) for g, t in enumerate(_groups())]
    arrays, _ = make_batch(groups, 1, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    assert arrays["routes_BxTxLxK"].shape[2:] == (L, K)
