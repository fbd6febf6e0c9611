"""Pure chain decisions: order, election, splicing."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from fnrl.relay.chain import (AlreadyInChain, ChainPlan, detection_window_s, elect_master, join,
                              plan_chain, repair)
from fnrl.config import RelayConfig


def test_plan_puts_master_first_and_keeps_the_rest_in_order():
    assert plan_chain(["a", "b", "c", "d"], "c") == ("c", "a", "b", "d")
    assert plan_chain(["a", "b"], None) == ("a", "b")
    assert plan_chain(["a", "b"], "gone") == ("a", "b")
    with pytest.raises(ValueError, match="repeat"):
        plan_chain(["a", "a"], None)


def test_downstream_of():
    plan = ChainPlan(order=("m", "x", "y"), epoch=0)
    assert [plan.downstream_of(n) for n in plan.order] == ["x", "y", None]


def test_election_prefers_newest_version_then_chain_order():
    assert elect_master(["a", "b", "c"], {"a": 3, "b": 5, "c": 5}) == "b"
    assert elect_master(["a", "b"], {"a": None, "b": None}) == "a"
    assert elect_master(["a", "b"], {"b": 0}) == "b"
    assert elect_master([], {}) is None


def test_repair_splices_a_dead_middle_relay():
    plan = ChainPlan(order=("m", "a", "b", "c"), epoch=4)
    fixed = repair(plan, ["c", "m", "b"], {})  # a dead; the order of `alive` does not matter
    assert fixed.order == ("m", "b", "c") and fixed.epoch == 5
    assert fixed.downstream_of("m") == "b"
    assert repair(plan, list(plan.order), {}) is plan


def test_repair_elects_a_new_master_when_the_master_dies():
    plan = ChainPlan(order=("m", "a", "b"), epoch=0)
    fixed = repair(plan, ["a", "b"], {"a": 6, "b": 7})
    assert fixed.order == ("b", "a") and fixed.master == "b"


@given(st.lists(st.booleans(), min_size=1, max_size=9), st.data())
def test_repair_keeps_survivors_in_order_and_a_live_master(alive_mask, data):
    names = [f"r{i}" for i in range(len(alive_mask))]
    plan = ChainPlan(order=tuple(names), epoch=0)
    alive = [n for n, a in zip(names, alive_mask) if a]
    versions = {n: data.draw(st.one_of(st.none(), st.integers(0, 3))) for n in alive}
    fixed = repair(plan, alive, versions)
    assert set(fixed.order) == set(alive)
    if alive:
        assert fixed.master in alive
        rest = [n for n in names if n in alive and n != fixed.master]
        assert list(fixed.order[1:]) == rest  # splicing never reorders survivors
        if plan.master not in alive:
            newest = max(-1 if v is None else v for v in versions.values())
            assert (-1 if versions[fixed.master] is None else versions[fixed.master]) == newest


@pytest.mark.parametrize("field,value", [("chunk_bytes", 0), ("chunk_bytes", 100),
                                         ("num_relays", 0), ("chunk_timeout_s", -1.0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"RelayConfig.{field}={value}"):
        RelayConfig(**{field: value})


def test_rollouts_pull_from_their_own_relay_and_move_to_survivors_when_it_dies():
    from fnrl.relay.tier import RelayMember, RelayTier

    tier = RelayTier([RelayMember(name=f"r{i}", address=f"tcp://r{i}", ucx_address="")
                      for i in range(3)], RelayConfig(num_relays=3))
    assert [tier.local_address(i) for i in range(6)] == [f"tcp://r{i % 3}" for i in range(6)]
    tier.plan = repair(tier.plan, ["r1", "r2"], {"r1": 4, "r2": 4})  # the master r0 died
    assert tier.plan.order == ("r1", "r2")
    moved = [tier.local_address(i) for i in (0, 3)]
    assert set(moved) == {"tcp://r1", "tcp://r2"}  # spread over the survivors
    assert [tier.local_address(i) for i in (1, 2, 4, 5)] == ["tcp://r1", "tcp://r2"] * 2
    tier.plan = repair(tier.plan, [], {})
    with pytest.raises(RuntimeError, match="every relay"):
        tier.local_address(0)


def test_detection_window_is_a_round_to_notice_plus_the_missed_pings():
    cfg = RelayConfig(heartbeat_s=0.5, heartbeat_timeout_s=2.0, heartbeat_misses=3)
    assert detection_window_s(cfg) == 0.5 + 3 * (0.5 + 2.0)


def test_a_replacement_joins_at_the_tail_in_a_new_epoch():
    plan = repair(ChainPlan(order=("m", "x", "y"), epoch=2), ["m", "y"], {})
    joined = join(plan, "x")
    assert joined == ChainPlan(order=("m", "y", "x"), epoch=4)
    # The old tail now forwards to the newcomer; the master and its neighbour keep theirs.
    assert [joined.downstream_of(n) for n in joined.order] == ["y", "x", None]
    assert join(ChainPlan(order=(), epoch=5), "x").master == "x"
    with pytest.raises(AlreadyInChain, match="'y'"):
        join(joined, "y")
