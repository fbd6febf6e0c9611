"""Routes (rollout routing replay) as values: compact bytes, sliced and joined by
position, compared by value, round-tripped through JSON; a trajectory's routes cover
every position of prompt + response."""

import json

import numpy as np
import pytest

from fnrl.types import Routes, Segment, StreamChunk, Trajectory


def test_routes_hold_small_ids_in_a_byte_and_large_ones_in_two():
    ids = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    small = Routes.of(ids)
    assert (len(small), small.layers, small.top_k, small.itemsize) == (2, 3, 2, 1)
    assert len(small.data) == ids.size   # one byte an id
    np.testing.assert_array_equal(small.array(), ids)
    wide = Routes.of(ids + 250)          # ids up to 261: uint16
    assert wide.itemsize == 2 and len(wide.data) == 2 * ids.size
    np.testing.assert_array_equal(wide.array(), ids + 250)
    with pytest.raises(ValueError, match="below 65,536"):
        Routes.of(ids - 1)
    with pytest.raises(ValueError, match=r"\[positions, layers, top_k\]"):
        Routes.of(ids[0])
    with pytest.raises(ValueError, match="not whole positions"):
        Routes(b"\x00" * 5, 3, 2)


def test_routes_slice_join_and_pad_by_position():
    a = Routes.of(np.arange(8).reshape(4, 2, 1))
    np.testing.assert_array_equal(a[1:3].array(), np.arange(2, 6).reshape(2, 2, 1))
    assert a[:2] + a[2:] == a and len(a[4:]) == 0
    joined = a[:1] + Routes.of([[[300], [301]]])   # widened to uint16 to join
    np.testing.assert_array_equal(joined.array()[:, :, 0], [[0, 1], [300, 301]])
    np.testing.assert_array_equal(a.padded(6).array()[4:], 0)
    with pytest.raises(ValueError, match="cannot join"):
        a + Routes.of([[[1]]])
    with pytest.raises(ValueError, match="more than 3"):
        a.padded(3)


def test_routes_are_values_and_json():
    a = Routes.of([[[1, 2], [0, 3]], [[2, 3], [1, 0]]])
    assert a == Routes.of(np.array([[[1, 2], [0, 3]], [[2, 3], [1, 0]]], np.int64))
    assert hash(a) == hash(Routes.from_json(json.loads(json.dumps(a.to_json()))))
    assert Routes.from_json(a.to_json()) == a
    assert a != Routes.of([[[1, 2], [0, 3]], [[2, 3], [1, 1]]])


def test_a_trajectorys_routes_cover_prompt_and_response():
    segs = (Segment(0, (5, 6), (-1.0, -1.0)), Segment(1, (7,), (-1.0,)))
    Trajectory("t", (1,), segs, "stop", routes=Routes.of(np.zeros((4, 1, 1), int)))
    with pytest.raises(ValueError, match="4 positions .* but routes for 3"):
        Trajectory("t", (1,), segs, "stop", routes=Routes.of(np.zeros((3, 1, 1), int)))
    assert Trajectory("t", (1,), segs, "stop").routes is None   # not recorded


def test_routes_come_on_a_requests_last_chunk():
    r = Routes.of([[[1]]])
    assert StreamChunk((5,), (-1.0,), "stop", routes=r, routes_from=3).routes_from == 3
    with pytest.raises(ValueError, match="last chunk"):
        StreamChunk((5,), (-1.0,), None, routes=r)
