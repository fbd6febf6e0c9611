"""Partial response pool: durable streamed tokens, replay, torn-tail recovery."""

import math

import pytest
from hypothesis import given, settings, strategies as hst

from fnrl.data.partial_pool import PartialResponsePool
from fnrl.types import Segment


def test_segments_follow_versions_and_survive_reopen(tmp_path):
    path = tmp_path / "pool.log"
    lps = [-0.1, -1 / 3, -math.pi]           # exact floats must come back bit-identical
    with PartialResponsePool(path) as pool:
        pool.start("a", [1, 2])
        pool.append("a", 3, [10, 11], lps[:2])
        pool.append("a", 3, [12], lps[2:])        # same version: same segment
        pool.append("a", 4, [13], [-2.0])         # interrupted, resumed on version 4
        pool.start("b", [5])
        pool.finish("a", "stop")
        pool.drop("b")
    with PartialResponsePool(path) as pool:
        assert pool.live() == ("a",)
        a = pool.get("a")
        assert a.prompt_ids == (1, 2) and a.finish_reason == "stop"
        assert a.segments == (Segment(3, (10, 11, 12), tuple(lps)), Segment(4, (13,), (-2.0,)))


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_torn_last_record_is_cut_and_nothing_else_lost(tmp_path, cut):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        pool.start("a", [1])
        pool.append("a", 0, [7], [-0.5])
    good = path.stat().st_size
    with PartialResponsePool(path) as pool:
        pool.append("a", 0, [8, 9], [-0.25, -0.125])
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - cut])          # crash mid-write of the last record
    with PartialResponsePool(path) as pool:
        assert pool.recovered_bytes_dropped == len(data) - cut - good
        assert pool.get("a").segments == (Segment(0, (7,), (-0.5,)),)
        pool.append("a", 0, [8], [-0.25])             # the log is writable again
    with PartialResponsePool(path) as pool:
        assert pool.get("a").segments == (Segment(0, (7, 8), (-0.5, -0.25)),)


def test_corrupted_payload_is_detected(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        pool.start("a", [1])
        pool.append("a", 0, [7], [-0.5])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with PartialResponsePool(path) as pool:
        assert pool.get("a").segments == ()


def test_compact_keeps_only_live(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        for i in range(20):
            pool.start(str(i), [i])
            pool.append(str(i), 0, [i] * 10, [-1.0] * 10)
            if i % 2:
                pool.drop(str(i))
        before = path.stat().st_size
        pool.compact()
        assert path.stat().st_size < before
        pool.append("0", 1, [99], [-3.0])
    with PartialResponsePool(path) as pool:
        assert pool.live() == tuple(str(i) for i in range(0, 20, 2))
        assert pool.get("0").segments[-1] == Segment(1, (99,), (-3.0,))


def test_errors(tmp_path):
    with PartialResponsePool(tmp_path / "p.log") as pool:
        with pytest.raises(KeyError):
            pool.append("x", 0, [1], [0.0])
        pool.start("x", [])
        with pytest.raises(ValueError, match="log-probs"):
            pool.append("x", 0, [1, 2], [0.0])
        with pytest.raises(ValueError, match="already"):
            pool.start("x", [])


@settings(max_examples=30, deadline=None)
@given(chunks=hst.lists(hst.tuples(hst.integers(0, 3), hst.integers(0, 2), hst.integers(1, 4)),
                        min_size=1, max_size=25),
       cut=hst.integers(0, 64))
def test_replay_equals_memory_up_to_any_crash(tmp_path_factory, chunks, cut):
    """Whatever the crash point, reopening gives a prefix of the acknowledged history."""
    path = tmp_path_factory.mktemp("pool") / "pool.log"
    history = []
    with PartialResponsePool(path) as pool:
        for u in "abcd":
            pool.start(u, [0])
        for who, version, n in chunks:
            uid = "abcd"[who]
            pool.append(uid, version, list(range(n)), [-0.5 * k for k in range(n)])
            history.append({u: pool.get(u) for u in "abcd"})
    data = path.read_bytes()
    path.write_bytes(data[:max(0, len(data) - cut)])
    with PartialResponsePool(path) as pool:
        got = {u: pool.get(u) for u in pool.live()}
    if len(got) == 4:
        assert got in history or all(len(g.segments) == 0 for g in got.values())
