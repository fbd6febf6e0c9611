"""Experience buffer: exact takes, eviction, discard."""

import pytest

from fnrl.data.experience import ExperienceBuffer, add, discard, take
from fnrl.types import Group, Problem, Segment, Trajectory


def group(version: int, uid: str) -> Group:
    t = Trajectory(uid, (1,), (Segment(version, (2,), (-0.1,)),), "stop", 1.0)
    return Group(Problem(uid, "1+1=", "2", 1), (t,))


def filled(capacity=None):
    buf, _ = add(ExperienceBuffer(capacity=capacity),
                 [(10, group(3, "a")), (11, group(1, "b")), (12, group(2, "c"))])
    return buf


def test_take_exactly_the_consumed_groups():
    batch, rest = take(filled(), [12, 10])
    assert [x.gid for x in batch] == [12, 10] and len(rest) == 1
    with pytest.raises(KeyError, match="99"):
        take(filled(), [99])


def test_capacity_evicts_oldest_and_discard():
    buf, evicted = add(filled(capacity=3), [(13, group(4, "d"))])
    assert [x.gid for x in evicted] == [10] and [x.gid for x in buf.items] == [11, 12, 13]
    assert [x.gid for x in discard(buf, [12]).items] == [11, 13]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity=0"):
        ExperienceBuffer(capacity=0)
