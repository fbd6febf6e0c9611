"""Experience buffer with registered samplers."""

import pytest

from fnrl.data.arith import Problem
from fnrl.data.experience import SAMPLERS, ExperienceBuffer, add, discard, sample, take
from fnrl.types import Group, Segment, Trajectory


def group(version: int, uid: str) -> Group:
    t = Trajectory(uid, (1,), (Segment(version, (2,), (-0.1,)),), "stop", 1.0)
    return Group(Problem(uid, "1+1=", "2", 1), (t,))


def filled(capacity=None):
    buf, _ = add(ExperienceBuffer(capacity=capacity),
                 [(10, group(3, "a")), (11, group(1, "b")), (12, group(2, "c"))])
    return buf


def test_fifo_is_arrival_order():
    batch, rest = sample(filled(), 2, "fifo")
    assert [x.gid for x in batch] == [10, 11] and [x.gid for x in rest.items] == [12]


def test_oldest_version_first():
    batch, rest = sample(filled(), 2, "oldest_version")
    assert [x.gid for x in batch] == [11, 12] and [x.gid for x in rest.items] == [10]


def test_take_exactly_the_consumed_groups():
    batch, rest = take(filled(), [12, 10])
    assert [x.gid for x in batch] == [12, 10] and len(rest) == 1
    with pytest.raises(KeyError, match="99"):
        take(filled(), [99])


def test_capacity_evicts_oldest_and_discard():
    buf, evicted = add(filled(capacity=3), [(13, group(4, "d"))])
    assert [x.gid for x in evicted] == [10] and [x.gid for x in buf.items] == [11, 12, 13]
    assert [x.gid for x in discard(buf, [12]).items] == [11, 13]


def test_unknown_sampler_and_registry():
    assert set(SAMPLERS) >= {"fifo", "oldest_version"}
    with pytest.raises(ValueError, match="unknown sampler"):
        sample(filled(), 1, "priority")
    with pytest.raises(ValueError, match="capacity=0"):
        ExperienceBuffer(capacity=0)
