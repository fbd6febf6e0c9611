"""Routing replay through the partial response pool: the engine's routes of every
streamed token (and of the prompt) survive a restart, a compaction and a continuation."""

import pytest

from fnrl.data.partial_pool import PartialResponsePool
from fnrl.types import Segment, Trajectory


def routes(*experts):
    """Two layers, top-2: token i routed to (e, e+1) in layer 0 and (e+2, e+3) in 1."""
    return tuple(((e, e + 1), (e + 2, e + 3)) for e in experts)


def test_routes_survive_a_restart_and_a_compaction(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        pool.start("a", [1, 2])
        assert pool.set_prompt_routes("a", routes(10, 20))
        pool.append("a", 3, [7, 8], [-0.5, -0.25], routes=routes(1, 2))
        pool.append("a", 3, [9], [-0.125], routes=routes(3))      # merged: same version
        pool.append("a", 4, [11], [-1.0], routes=routes(4))
    for reopen in range(2):
        with PartialResponsePool(path) as pool:   # the controller restarted: re-read
            a = pool.get("a")
            assert a.prompt_routes == routes(10, 20)
            assert a.segments == (Segment(3, (7, 8, 9), (-0.5, -0.25, -0.125),
                                          routes=routes(1, 2, 3)),
                                  Segment(4, (11,), (-1.0,), routes=routes(4)))
            if not reopen:
                pool.compact()                     # rewritten: routes kept


def test_a_continued_trajectory_keeps_the_routes_of_its_earlier_tokens(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:   # rollout 0 streams 2 tokens, then is cut off
        pool.start("a", [1, 2, 3], prompt_routes=routes(30, 31, 32))
        pool.append("a", 0, [7, 8], [-0.5, -0.5], routes=routes(5, 6))
    with PartialResponsePool(path) as pool:   # restarted; migrated to rollout 1 (version 1)
        # The continuation re-prefills prompt + streamed tokens and reports their routes
        # again: the pool keeps the first placement's.
        assert not pool.set_prompt_routes("a", routes(90, 91, 92))
        pool.append("a", 1, [9], [-0.25], routes=routes(7))
        pool.finish("a", "stop")
    with PartialResponsePool(path) as pool:
        item = pool.get("a")
        traj = Trajectory("a", item.prompt_ids, item.segments, item.finish_reason,
                          prompt_routes=item.prompt_routes)
        assert traj.prompt_routes == routes(30, 31, 32)
        assert traj.routes == routes(5, 6, 7) and traj.response_ids == (7, 8, 9)


def test_logs_without_routes_still_load_and_routes_cannot_be_mixed(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:   # a run without routing replay
        pool.start("a", [1])
        pool.append("a", 0, [7], [-0.5])
    raw = path.read_bytes()
    assert b"routes" not in raw               # its records are what they always were
    with PartialResponsePool(path) as pool:
        assert pool.get("a").segments == (Segment(0, (7,), (-0.5,)),)
        assert pool.get("a").prompt_routes is None
        with pytest.raises(ValueError, match="1 tokens with routes after 1 without"):
            pool.append("a", 0, [8], [-0.5], routes=routes(1))
        pool.start("b", [1])
        pool.append("b", 0, [7], [-0.5], routes=routes(1))
        with pytest.raises(ValueError, match="1 tokens without routes after 1 with"):
            pool.append("b", 1, [8], [-0.5])
        with pytest.raises(ValueError, match="2 tokens but routes for 1"):
            pool.append("b", 0, [8, 9], [-0.5, -0.5], routes=routes(1))
        with pytest.raises(ValueError, match="prompt has 1 tokens but routes for 2"):
            pool.set_prompt_routes("b", routes(1, 2))
    assert path.read_bytes().startswith(raw)  # nothing refused was written
    with PartialResponsePool(path) as pool:
        assert pool.get("b").segments == (Segment(0, (7,), (-0.5,), routes=routes(1)),)
