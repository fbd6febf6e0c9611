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


# GPUs (node_gpus, trainer_gpus, server_gpus = the tensor-parallel size).

def test_tensor_parallel_2_on_nodes_of_4_4_2_gpus_worked_by_hand():
    gpus = {"a": 4, "b": 4, "c": 2}
    # Trainer: 2 processes x 2 GPUs fill a. Rollouts round-robin over b, c: b takes
    # GPUs 0-1, c its only two, then b again its 2-3.
    plan = place_roles(("a", "b", "c"), 3, node_gpus=gpus, trainer_gpus=4, server_gpus=2)
    assert (plan.trainer, plan.rollouts, plan.relays) == ("a", ("b", "c", "b"), ("a", "b", "c"))
    assert plan.gpus == {"trainer": (0, 1, 2, 3), "rollout0": (0, 1), "rollout1": (0, 1),
                         "rollout2": (2, 3)}
    assert [plan.gpus_on(n) for n in "abc"] == [4, 4, 2]
    # Two rollouts and the evaluation server: it goes where 2 GPUs are still free (b),
    # not to the least-loaded node by count alone.
    plan = place_roles(("a", "b", "c"), 2, node_gpus=gpus, trainer_gpus=4, server_gpus=2,
                       with_eval=True)
    assert (plan.rollouts, plan.eval, plan.gpus["eval"]) == (("b", "c"), "b", (2, 3))


def test_a_full_node_is_skipped_in_the_round_robin():
    gpus = {"a": 4, "b": 2, "c": 4, "d": 2}
    plan = place_roles(("a", "b", "c", "d"), 4, node_gpus=gpus, trainer_gpus=4, server_gpus=2)
    # b and d are full after one server each: the fourth goes to c, after d.
    assert plan.rollouts == ("b", "c", "d", "c")
    assert plan.gpus["rollout3"] == (2, 3)


def test_too_few_gpus_are_refused_with_the_figures():
    with pytest.raises(ValueError, match=r"rollout2 needs 4 GPUs \(tensor-parallel 4\); "
                                         r"free: b 2, c 0"):
        place_roles(("a", "b", "c"), 3, node_gpus={"a": 4, "b": 6, "c": 4},
                    trainer_gpus=4, server_gpus=4)
    with pytest.raises(ValueError, match="the trainer needs 4 GPUs on its node; free: a 2"):
        place_roles(("a", "b"), 1, node_gpus={"a": 2, "b": 8}, trainer_gpus=4)
    with pytest.raises(ValueError, match=r"evaluation server needs 2 GPUs .*free: b 0, c 0"):
        place_roles(("a", "b", "c"), 3, node_gpus={"a": 4, "b": 4, "c": 2},
                    trainer_gpus=4, server_gpus=2, with_eval=True)
    # A trainer that asks for GPUs on a CPU cluster is refused too (servers need none).
    with pytest.raises(ValueError, match="the trainer needs 1 GPUs on its node; free: a 0"):
        place_roles(("a", "b"), 1, node_gpus={"a": 0, "b": 0}, trainer_gpus=1)


@given(nodes=names, rollouts=st.integers(1, 12), with_eval=st.booleans(),
       tp=st.integers(1, 8), data=st.data())
def test_a_cpu_cluster_is_placed_as_without_gpus(nodes, rollouts, with_eval, tp, data):
    trainer = data.draw(st.sampled_from(nodes))
    plan = place_roles(nodes, rollouts, trainer_node=trainer, with_eval=with_eval)
    cpu = place_roles(nodes, rollouts, trainer_node=trainer, with_eval=with_eval,
                      node_gpus=dict.fromkeys(nodes, 0), server_gpus=tp)
    assert cpu == plan and cpu.gpus == {}


@given(nodes=names, rollouts=st.integers(1, 8), with_eval=st.booleans(),
       tp=st.integers(1, 4), per_trainer=st.integers(0, 4), data=st.data())
def test_gpus_are_disjoint_per_node_and_within_its_count(nodes, rollouts, with_eval, tp,
                                                         per_trainer, data):
    gpus = {n: data.draw(st.integers(0, 8), label=f"gpus[{n}]") for n in nodes}
    try:
        plan = place_roles(nodes, rollouts, with_eval=with_eval, node_gpus=gpus,
                           trainer_gpus=per_trainer, server_gpus=tp)
    except ValueError as err:
        assert "needs" in str(err) and "free:" in str(err)
        return
    if not any(gpus.values()):
        return
    servers = [f"rollout{i}" for i in range(rollouts)] + (["eval"] if with_eval else [])
    assert all(len(plan.gpus[s]) == tp for s in servers)
    assert len(plan.gpus.get("trainer", ())) == per_trainer
    for node in nodes:
        held = [i for role, ids in plan.gpus.items() if plan.node_of(role) == node
                for i in ids]
        assert len(held) == len(set(held)) and all(0 <= i < gpus[node] for i in held)
    # The rules without GPUs still hold: rollouts avoid the trainer's node if they can.
    others = [n for n in nodes if n != plan.trainer]
    assert set(plan.rollouts) <= set(others or [plan.trainer])
