"""Routing replay through the partial response pool: the engine's routes of each
position (prompt + response), reported per request from the first position not yet
covered, survive a restart, a compaction, an interrupt and a continuation."""

import numpy as np
import pytest

from fnrl.data.partial_pool import PartialResponsePool
from fnrl.types import Routes, Segment, Trajectory


def routes(*experts):
    """Two layers, top-2: position i routed to (e, e+1) in layer 0 and (e+2, e+3) in 1."""
    return Routes.of([((e, e + 1), (e + 2, e + 3)) for e in experts])


def test_routes_survive_a_restart_and_a_compaction(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        pool.start("a", [1, 2])
        pool.append("a", 3, [7, 8], [-0.5, -0.25])
        # The request's report: prompt and the first generated token (the last one
        # generated was never fed, so it has none yet).
        assert pool.add_routes("a", 0, routes(10, 20, 1)) == 3
        pool.append("a", 4, [11], [-1.0])
        assert pool.routes_covered("a") == 3
    for reopen in range(2):
        with PartialResponsePool(path) as pool:   # the controller restarted: re-read
            a = pool.get("a")
            assert a.routes == routes(10, 20, 1) and pool.routes_covered("a") == 3
            assert a.segments == (Segment(3, (7, 8), (-0.5, -0.25)), Segment(4, (11,), (-1.0,)))
            if not reopen:
                pool.compact()                     # rewritten: routes kept


def test_an_interrupted_trajectory_gets_every_positions_routes_from_its_continuation(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:   # rollout 0 streams 2 tokens, then is cut off:
        pool.start("a", [1, 2, 3])            # its connection dropped, no report came
        pool.append("a", 0, [7, 8], [-0.5, -0.5])
        assert pool.routes_covered("a") == 0
    with PartialResponsePool(path) as pool:   # restarted; migrated to rollout 1 (version 1)
        # The continuation asks from position 0 and reports prompt + streamed + its own
        # tokens but the last.
        pool.append("a", 1, [9, 10], [-0.25, -0.25])
        pool.add_routes("a", pool.routes_covered("a"), routes(30, 31, 32, 5, 6, 7))
        pool.finish("a", "stop")
    with PartialResponsePool(path) as pool:
        item = pool.get("a")
        traj = Trajectory("a", item.prompt_ids, item.segments, item.finish_reason,
                          routes=item.trajectory_routes())
        # The last token is only a target: expert 0.
        assert traj.routes == routes(30, 31, 32, 5, 6, 7) + Routes.of(np.zeros((1, 2, 2), int))
        assert traj.response_ids == (7, 8, 9, 10)


def test_positions_already_covered_keep_their_first_report(tmp_path):
    with PartialResponsePool(tmp_path / "pool.log") as pool:
        pool.start("a", [1, 2])
        pool.append("a", 0, [7, 8], [-0.5, -0.5])
        pool.add_routes("a", 0, routes(10, 11, 12))
        pool.append("a", 1, [9], [-0.5])
        # A report from an earlier position (a re-prefill under version 1): only the
        # position not yet covered is taken.
        assert pool.add_routes("a", 1, routes(91, 92, 13)) == 1
        assert pool.get("a").routes == routes(10, 11, 12, 13)
        assert pool.add_routes("a", 0, routes(90)) == 0


def test_gaps_and_reports_past_the_end_are_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:   # a run without routing replay
        pool.start("a", [1])
        pool.append("a", 0, [7], [-0.5])
        assert pool.get("a").routes is None and pool.get("a").trajectory_routes() is None
    raw = path.read_bytes()
    assert b"routes" not in raw               # its records are what they always were
    with PartialResponsePool(path) as pool:
        with pytest.raises(ValueError, match="positions 1..1, but 0 of its 2"):
            pool.add_routes("a", 1, routes(5))
        with pytest.raises(ValueError, match="positions 0..2, but 0 of its 2"):
            pool.add_routes("a", 0, routes(5, 6, 7))
        pool.add_routes("a", 0, routes(5))
        with pytest.raises(ValueError, match="1 layers x top_k 1 after 2 x 2"):
            pool.add_routes("a", 1, Routes.of([[[1]]]))
        # One of two positions covered: the last token's routes are never reported, so
        # this trajectory's are complete.
        assert pool.get("a").trajectory_routes() == routes(5) + Routes.of(np.zeros((1, 2, 2), int))
        pool.append("a", 0, [8], [-0.5])       # one more token: position 1 now lacks routes
        assert pool.get("a").trajectory_routes() is None
    with PartialResponsePool(path) as pool:
        assert pool.get("a").routes == routes(5)
