"""The shared-memory store on its own, in one process (no relay)."""

from __future__ import annotations

import uuid

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from fnrl.relay import store


@pytest.fixture
def segment_name():
    name = f"fnrl-test-{uuid.uuid4().hex}"
    yield name
    store.unlink_segment(name)


def write(manifest: store.VersionManifest, arrays: dict[str, np.ndarray]) -> None:
    mm = store.create_segment(manifest.segment, manifest.total_bytes)
    for spec in manifest.tensors:
        mm[spec.offset : spec.offset + spec.nbytes] = arrays[spec.name].tobytes()
    mm.close()


def layout_of(arrays: dict[str, np.ndarray], version: int, segment: str):
    return store.plan_layout(
        version=version,
        segment=segment,
        tensors=[(k, a.shape, str(a.dtype)) for k, a in arrays.items()],
    )


def test_manifest_json_round_trip():
    manifest = store.plan_layout(
        version=7, segment="s", tensors=[("a", (2, 3), "float32"), ("b", (), "bfloat16")]
    )
    assert store.VersionManifest.from_json(manifest.to_json()) == manifest
    assert manifest.tensors[1].offset == 64 and manifest.tensors[1].nbytes == 2


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 9), max_size=3),
            st.sampled_from(["float32", "bfloat16", "int8", "float64"]),
        ),
        max_size=8,
    )
)
def test_layout_is_aligned_and_disjoint(shapes_dtypes):
    tensors = [(f"t{i}", tuple(s), d) for i, (s, d) in enumerate(shapes_dtypes)]
    manifest = store.plan_layout(version=0, segment="s", tensors=tensors)
    end = 0
    for spec, (_, shape, dtype) in zip(manifest.tensors, tensors):
        assert spec.offset % store.ALIGNMENT == 0 and spec.offset >= end
        assert spec.nbytes == int(np.prod(shape)) * store.numpy_dtype(dtype).itemsize
        end = spec.offset + spec.nbytes
    assert manifest.total_bytes >= end and manifest.total_bytes % store.ALIGNMENT == 0


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="twice"):
        store.plan_layout(version=0, segment="s", tensors=[("a", (1,), "int8")] * 2)


def test_open_version_gives_read_only_views_that_outlive_unlink(segment_name):
    arrays = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.array([1, -2, 3], dtype=np.int32),
        "e": np.zeros((0, 5), dtype=np.float16),
    }
    manifest = layout_of(arrays, 1, segment_name)
    write(manifest, arrays)
    views = store.open_version(manifest)
    store.unlink_segment(segment_name)  # POSIX: the mapping stays valid
    for name, a in arrays.items():
        np.testing.assert_array_equal(views[name], a)
        assert views[name].dtype == a.dtype and not views[name].flags.writeable
    with pytest.raises(ValueError):
        views["w"][0, 0] = 1.0
    with pytest.raises(FileNotFoundError):
        store.open_version(manifest)


def test_short_segment_rejected(segment_name):
    store.create_segment(segment_name, 64).close()
    fits = store.plan_layout(version=1, segment=segment_name, tensors=[("a", (64,), "int8")])
    assert store.open_version(fits)["a"].shape == (64,)
    too_big = store.plan_layout(version=1, segment=segment_name, tensors=[("a", (65,), "int8")])
    with pytest.raises(ValueError, match="needs 128"):
        store.open_version(too_big)


def test_a_reused_segment_is_mapped_once_and_locked_only_while_read(segment_name):
    # A relay renames a retired segment and writes the next version into it: the reader
    # reuses its mapping, yet holds the segment's lock only while it reads.
    first = {"w": np.full((1000,), 1.0, np.float32)}
    manifest = layout_of(first, 1, segment_name)
    write(manifest, first)
    views = store.open_version(manifest)
    assert store.has_readers(segment_name)
    mapping = views["w"].base.base.obj  # view -> locked array -> memoryview -> mmap
    del views
    assert not store.has_readers(segment_name)
    reused = f"{segment_name}-reused"
    store.rename_segment(segment_name, reused)
    try:
        with pytest.raises(FileNotFoundError):
            store.open_version(manifest)
        second = {"w": np.full((1000,), 2.0, np.float32)}
        with open(store.SHM_DIR / reused, "r+b") as f:  # the writer fills the reused one
            f.write(second["w"].tobytes())
        views = store.open_version(layout_of(second, 2, reused))
        np.testing.assert_array_equal(views["w"], second["w"])
        assert views["w"].base.base.obj is mapping
    finally:
        store.unlink_segment(reused)
