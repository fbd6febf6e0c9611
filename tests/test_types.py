"""Routes on the values that flow through fnrl: validated per token, joined in order."""

import json

import pytest

from fnrl.types import Segment, StreamChunk, Trajectory, concat_routes


def routes(*experts):
    """One layer, top-1: token i routed to experts[i]."""
    return tuple(((e,),) for e in experts)


def test_routes_count_must_match_tokens():
    with pytest.raises(ValueError, match="2 tokens but routes for 1"):
        Segment(0, (5, 6), (-1.0, -1.0), routes=routes(3))
    with pytest.raises(ValueError, match="1 tokens but routes for 2"):
        StreamChunk((5,), (-1.0,), None, routes=routes(1, 2))
    with pytest.raises(ValueError, match="prompt has 3 tokens but routes for 2"):
        Trajectory("t", (1, 2, 3), (), "stop", prompt_routes=routes(0, 1))


def test_routes_are_hashable_and_json():
    seg = Segment(0, (5, 6), (-1.0, -1.0), routes=(((1, 2), (0, 3)), ((2, 3), (1, 0))))
    assert hash(seg) == hash(Segment(0, (5, 6), (-1.0, -1.0),
                                     routes=(((1, 2), (0, 3)), ((2, 3), (1, 0)))))
    assert json.loads(json.dumps(seg.routes)) == [[[1, 2], [0, 3]], [[2, 3], [1, 0]]]
    assert Segment(0, (5,), (-1.0,)).routes is None   # the default: not recorded


def test_trajectory_routes_join_segments_in_order():
    traj = Trajectory("t", (1,), (Segment(0, (5, 6), (-1.0, -1.0), routes=routes(3, 4)),
                                  Segment(1, (7,), (-1.0,), routes=routes(2))), "stop",
                      prompt_routes=routes(0))
    assert traj.routes == routes(3, 4, 2) and traj.prompt_routes == routes(0)
    plain = Trajectory("t", (1,), (Segment(0, (5,), (-1.0,)),), "stop")
    assert plain.routes is None and plain.prompt_routes is None


def test_mixing_segments_with_and_without_routes_is_refused():
    traj = Trajectory("t", (1,), (Segment(0, (5,), (-1.0,), routes=routes(3)),
                                  Segment(1, (7,), (-1.0,))), "stop")
    with pytest.raises(ValueError, match="trajectory 't'.*some pieces carry routes"):
        traj.routes
    assert concat_routes((None, None), "x") is None
    assert concat_routes((routes(1), (), routes(2)), "x") == routes(1, 2)
