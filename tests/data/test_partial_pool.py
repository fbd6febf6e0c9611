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


def _damaged_at(path, offset, n=16):
    data = bytearray(path.read_bytes())
    data[offset + 10:offset + 10 + n] = b"\x00" * n      # inside the record's payload
    path.write_bytes(bytes(data) + b"\x13garbage")     # and a torn tail after everything


def test_damage_in_the_middle_discards_only_the_trajectory_it_broke(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        pool.start("a", [1])
        pool.append("a", 0, [7, 8], [-0.5, -0.25])
        pool.start("b", [2])
        pool.append("b", 0, [9], [-1.0])
        offset = path.stat().st_size
        pool.append("a", 1, [10], [-0.125])        # the record the damage will hit
        pool.append("a", 1, [11], [-0.5])          # ...with a later one of a: a gap
        pool.append("b", 1, [12], [-2.0])
        pool.finish("b", "stop")
        pool.start("c", [3])                       # after the damage: untouched
        pool.append("c", 1, [13, 14], [-0.5, -0.5])
        before = {uid: pool.get(uid) for uid in ("b", "c")}
    _damaged_at(path, offset)
    with PartialResponsePool(path) as pool:
        r = pool.recovery
        assert r.damaged_offsets == (offset,) and r.damaged_bytes > 0 and r.torn_bytes == 8
        assert r.discarded_uids == ("a",) and r.discarded_tokens == 2
        assert pool.live() == ("b", "c") and {u: pool.get(u) for u in ("b", "c")} == before
        assert "1 trajectories it broke discarded (2 tokens" in r.describe(path)
        pool.append("c", 2, [15], [-0.5])          # writable, after the compacted log
    assert (tmp_path / "pool.log.damaged").exists()
    with PartialResponsePool(path) as pool:        # the damage was read once
        assert pool.recovery.damaged_bytes == 0 and pool.live() == ("b", "c")
        assert pool.get("c").num_tokens == 3


def test_damage_in_a_log_from_before_numbering_discards_everything_live_at_it(tmp_path):
    from fnrl.data.partial_pool import _encode

    path = tmp_path / "pool.log"
    records = [{"op": "start", "uid": "a", "prompt": [1]},
               {"op": "tokens", "uid": "a", "v": 0, "ids": [7], "lps": [-0.5]},
               {"op": "tokens", "uid": "a", "v": 0, "ids": [8], "lps": [-0.5]},
               {"op": "start", "uid": "b", "prompt": [2]},
               {"op": "tokens", "uid": "b", "v": 0, "ids": [9], "lps": [-0.5]}]
    blobs = [_encode(r) for r in records]
    path.write_bytes(b"".join(blobs))
    _damaged_at(path, len(blobs[0]) + len(blobs[1]), n=4)
    with PartialResponsePool(path) as pool:
        assert pool.recovery.discarded_uids == ("a",) and pool.recovery.discarded_tokens == 1
        assert pool.live() == ("b",) and pool.get("b").num_tokens == 1
