"""Registered samplers: which rewarded groups a Consume trains."""

from dataclasses import dataclass

import pytest

from fnrl.config import SAMPLER_NAMES, CoordinatorConfig
from fnrl.policy.samplers import SAMPLERS


@dataclass(frozen=True)
class Item:
    version: int
    seq: int


# Arrival order 0, 1, 2 with versions 3, 1, 2 (the two orders disagree).
ITEMS = (Item(3, 0), Item(1, 1), Item(2, 2))


def test_fifo_is_arrival_order():
    assert SAMPLERS["fifo"](ITEMS, 2) == (0, 1)
    assert SAMPLERS["fifo"](tuple(reversed(ITEMS)), 3) == (2, 1, 0)


def test_oldest_version_first_then_arrival():
    assert SAMPLERS["oldest_version"](ITEMS, 2) == (1, 2)
    assert SAMPLERS["oldest_version"]((Item(1, 5), Item(1, 4)), 2) == (1, 0)


def test_config_names_are_the_registry():
    assert sorted(SAMPLER_NAMES) == sorted(SAMPLERS)
    with pytest.raises(ValueError, match="CoordinatorConfig.sampler='priority'"):
        CoordinatorConfig(sampler="priority")


def test_protocol_keeps_the_listed_order():
    """No sampler: the items as listed, so choose_batch keeps the head as the protocol
    filled it, even where FIFO would take a group that arrived earlier."""
    from fnrl.policy import staleness as st

    assert SAMPLERS["protocol"](ITEMS, 2) == (0, 1)
    assert SAMPLERS["protocol"](tuple(reversed(ITEMS)), 3) == (0, 1, 2)
    head = (st.Entry(1, 2, True, 5), st.Entry(2, 2, True, 6))
    s = st.StalenessState(1, 2, 2, (head, (st.Entry(3, 2, True, 0),)))
    assert st.choose_batch(s, lambda es: SAMPLERS["protocol"](es, len(es))) == s
    fifo = st.choose_batch(s, lambda es: SAMPLERS["fifo"](es, len(es)))
    assert [e.gid for e in fifo.buffers[0]] == [3, 1]
