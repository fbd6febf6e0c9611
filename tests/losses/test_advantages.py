"""Advantage estimators, DAPO overlong shaping and dynamic sampling on tiny inputs."""

import numpy as np
import pytest

from fnrl.losses import ADVANTAGES
from fnrl.losses.advantages import overlong_penalty
from fnrl.policy.filtering import informative, select_groups

R = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])


def test_grpo_and_dr_grpo_golden():
    np.testing.assert_allclose(ADVANTAGES["grpo"](R, 0.0)[0], [1, -1, -1, 1], atol=1e-6)
    std = np.sqrt(0.5)
    np.testing.assert_allclose(ADVANTAGES["grpo"](R, 0.0)[1], [1 / std, -1 / std, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(ADVANTAGES["dr_grpo"](R), [[.5, -.5, -.5, .5], [1, -1, 0, 0]])


def test_rloo_is_leave_one_out():
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3, ...
    np.testing.assert_allclose(ADVANTAGES["rloo"](R)[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(ADVANTAGES["rloo"](R)[1], [4 / 3, -4 / 3, 0, 0], rtol=1e-6)


def test_reinforce_pp_whitens_over_the_batch():
    centred = R - R.mean(axis=1, keepdims=True)
    expected = (centred - centred.mean()) / centred.std()
    np.testing.assert_allclose(ADVANTAGES["reinforce_pp"](R, 0.0), expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_invalid_samples_get_zero_and_do_not_move_the_baseline(name):
    with_nan = np.array([[1.0, 0.0, np.nan, 1.0, 0.0]])
    adv = ADVANTAGES[name](with_nan, 1e-6)
    assert adv[0, 2] == 0.0
    np.testing.assert_allclose(adv[0, [0, 1, 3, 4]], ADVANTAGES[name](with_nan[:, [0, 1, 3, 4]],
                                                                      1e-6)[0], rtol=1e-6)


def test_overlong_penalty_ramps_over_the_buffer():
    pen = overlong_penalty([4, 6, 7, 8, 9], max_len=8, buffer=4, factor=1.0)
    np.testing.assert_allclose(pen, [0.0, -0.5, -0.75, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty([9], max_len=8, buffer=0), [0.0])


def test_dynamic_sampling_drops_zero_variance_and_keeps_the_batch_full():
    groups = [[1, 1], [0, 1], [0, 0], [1, 0], [None, 1], [0, 1]]
    assert not informative([None, 1]) and informative([0, 1])
    assert select_groups(groups, 2) == ((1, 3), (0, 2))
    # Only 3 informative groups exist: asking for 4 takes nothing, and says what to drop.
    assert select_groups(groups, 4) == ((), (0, 2, 4))


def test_group_std_divides_by_n():
    """Population std (ddof 0): (1, 0) has std 0.5 and advantages ±1; torch.std (n - 1,
    verl and TRL) would give std 0.71 and ±0.71."""
    np.testing.assert_allclose(ADVANTAGES["grpo"](np.array([[1.0, 0.0]]), 0.0), [[1.0, -1.0]])


def test_gpg_rescales_for_zero_variance_groups():
    # Group 1 has zero variance: M = 4 of B = 8 samples carry no signal, α = 8/4 = 2.
    flat = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(ADVANTAGES["gpg"](flat), [[1, -1, -1, 1], [0, 0, 0, 0]])
    # Every group informative: α = 1, plain r - mean.
    np.testing.assert_allclose(ADVANTAGES["gpg"](R), ADVANTAGES["dr_grpo"](R))


def test_opo_baseline_is_length_weighted():
    rewards = np.array([[1.0, 0.0, 1.0, np.nan]])
    lengths = np.array([[2, 4, 6, 100]])
    # b = (2·1 + 4·0 + 6·1) / 12 = 2/3; the invalid sample's length does not count.
    np.testing.assert_allclose(ADVANTAGES["opo"](rewards, lengths_GxN=lengths),
                               [[1 / 3, -2 / 3, 1 / 3, 0.0]], rtol=1e-6)
    # Equal lengths: the plain group mean.
    np.testing.assert_allclose(ADVANTAGES["opo"](R, lengths_GxN=np.full(R.shape, 5)),
                               ADVANTAGES["dr_grpo"](R), rtol=1e-6)
    with pytest.raises(ValueError, match="lengths"):
        ADVANTAGES["opo"](R)


def test_passk_analytic_advantages_golden():
    passk = ADVANTAGES["passk"]
    # n=4, c=1, k=2: R̄ = 1 - C(3,2)/C(4,2) = 1/2, σ = 1/2; A+ = (1/2)/(1/2) = 1,
    # A- = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3.
    np.testing.assert_allclose(passk(np.array([[0.0, 1.0, 0.0, 0.0]]), 0.0, pass_k=2),
                               [[-1 / 3, 1, -1 / 3, -1 / 3]], rtol=1e-6)
    # n=4, c=2, k=2: R̄ = 5/6, σ = √5/6; A± = ±(1/6)/σ = ±1/√5.
    np.testing.assert_allclose(passk(np.array([[1.0, 1.0, 0.0, 0.0]]), 0.0, pass_k=2),
                               [[1, 1, -1, -1] / np.sqrt(5)], rtol=1e-6)
    # Every 2-subset of (1, 1, 1, 0) holds a correct one; all wrong: no signal.
    np.testing.assert_allclose(passk(np.array([[1.0, 1.0, 1.0, 0.0], [0.0] * 4]), 0.0, pass_k=2),
                               np.zeros((2, 4)))
    # k = 1 is GRPO on binary rewards.
    binary = np.array([[1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(passk(binary, 0.0, pass_k=1), ADVANTAGES["grpo"](binary, 0.0),
                               rtol=1e-6)
    # k above the valid samples (3 here) uses k = n: the one subset holds the correct
    # answer, so no signal; the invalid sample keeps 0 and does not count in n.
    np.testing.assert_allclose(passk(np.array([[1.0, 0.0, 0.0, np.nan]]), 0.0, pass_k=8),
                               np.zeros((1, 4)))
    np.testing.assert_allclose(passk(np.array([[1.0, 0.0, 0.0, 0.0, np.nan]]), 0.0, pass_k=2),
                               [[1, -1 / 3, -1 / 3, -1 / 3, 0]], rtol=1e-6)


def test_compute_advantages_reads_the_config():
    from fnrl.config import AlgoConfig
    from fnrl.losses.advantages import compute_advantages

    rewards = np.array([[0.0, 1.0, 0.0, 0.0]])
    got = compute_advantages(rewards, AlgoConfig(advantage="passk", pass_k=2, adv_eps=0.0))
    np.testing.assert_allclose(got, [[-1 / 3, 1, -1 / 3, -1 / 3]], rtol=1e-6)
    got = compute_advantages(rewards, AlgoConfig(advantage="opo"), lengths_GxN=np.ones((1, 4)))
    np.testing.assert_allclose(got, [[-0.25, 0.75, -0.25, -0.25]], rtol=1e-6)
    with pytest.raises(ValueError, match="pass_k"):
        AlgoConfig(advantage="passk", pass_k=0)
