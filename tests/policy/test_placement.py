"""Role placement on named nodes: the rules of fnrl.policy.placement, as properties."""

import pytest
from hypothesis import given, strategies as st

from fnrl.policy.placement import place_roles

names = st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True)


@given(nodes=names, rollouts=st.integers(1, 12), with_eval=st.booleans(), data=st.data())
def test_placement_rules_hold(nodes, rollouts, with_eval, data):
    trainer = data.draw(st.sampled_from(nodes))
    plan = place_roles(nodes, rollouts, trainer_node=trainer, with_eval=with_eval)
    assert plan.trainer == trainer and len(plan.rollouts) == rollouts
    others = [n for n in nodes if n != trainer]
    # Rollouts avoid the trainer's node whenever there is another, and spread evenly.
    assert set(plan.rollouts) <= set(others or [trainer])
    counts = [plan.rollouts.count(n) for n in (others or [trainer])]
    assert max(counts) - min(counts) <= 1
    # One relay per used node, the trainer's first (the chain's master beside it), and
    # every rollout's home relay is on its own node.
    assert plan.relays[0] == trainer and len(set(plan.relays)) == len(plan.relays)
    assert set(plan.relays) == {trainer, *plan.rollouts}
    for rid in range(rollouts):
        assert plan.relays[plan.home_relay(rid)] == plan.rollouts[rid]
        assert plan.node_of(f"rollout{rid}") == plan.rollouts[rid]
    assert (plan.eval is not None) == with_eval
    if with_eval:
        assert plan.eval in (others or [trainer])
    assert place_roles(nodes, rollouts, trainer_node=trainer, with_eval=with_eval) == plan


def test_three_nodes_as_the_ray_test_places_them():
    plan = place_roles(("a", "b", "c"), 2)
    assert (plan.trainer, plan.rollouts, plan.relays) == ("a", ("b", "c"), ("a", "b", "c"))
    assert [plan.node_of(r) for r in ("trainer", "trainer_standby", "relay2")] == ["a", "a", "c"]


def test_bad_placements_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="trainer node 'z' is not in"):
        place_roles(("a", "b"), 1, trainer_node="z")
    with pytest.raises(ValueError, match="distinct"):
        place_roles(("a", "a"), 1)
    with pytest.raises(ValueError, match="at least one rollout"):
        place_roles(("a",), 0)
    with pytest.raises(KeyError, match="no node planned for role 'eval'"):
        place_roles(("a",), 1).node_of("eval")
