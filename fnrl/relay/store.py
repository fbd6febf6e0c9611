"""Versioned weight store in POSIX shared memory.

Each weight version lives in its own file `/dev/shm/<segment>`; a `VersionManifest`
says where every tensor sits in it and carries one xxh3-64 checksum per chunk. The
writer (the relay role) fills and verifies a segment completely before it makes the
manifest visible, and never writes it while it carries a version's name (multi-version
concurrency instead of StaleFlow's read-write lock: a reader never waits for a writer
and never blocks one). Once newer versions are complete the writer takes the name away
(rename or unlink); a reader that mapped the segment before keeps a valid mapping, and
one that comes later gets `FileNotFoundError` and asks for the new latest version.

Readers hold a shared `flock` on a segment for as long as they map it. The writer
reuses a retired segment for a later version (no page allocation, zeroing and freeing:
those cost several memory copies) only if it can take the lock exclusively, i.e. no
reader maps it; otherwise it unlinks it and POSIX keeps the pages for the reader.

We use os.open + mmap rather than `multiprocessing.shared_memory`: on Python 3.11 its
resource tracker unlinks segments that a process merely opened.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import xxhash

SHM_DIR = Path("/dev/shm")
ALIGNMENT = 64  # bytes; a cache line, and enough for any vectorised load


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Where one tensor lives inside a version's segment."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> TensorSpec:
        return cls(
            name=str(d["name"]),
            shape=tuple(int(x) for x in d["shape"]),
            dtype=str(d["dtype"]),
            offset=int(d["offset"]),
            nbytes=int(d["nbytes"]),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionManifest:
    """One complete weight version: its number, its segment and its tensor layout."""

    version: int
    segment: str
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    chunk_bytes: int = 0
    """Size of the checksummed chunks (the last may be shorter); 0 before checksums."""
    checksums: tuple[int, ...] = ()
    """xxh3-64 of each chunk of the segment's first `total_bytes` bytes."""

    @functools.cached_property
    def json_dict(self) -> dict:
        """The manifest as JSON values, built once (a relay answers every pull with it,
        and a mixture of experts' has tens of thousands of tensors); read-only."""
        return {
            "version": self.version,
            "segment": self.segment,
            "tensors": [t.to_dict() for t in self.tensors],
            "total_bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "checksums": list(self.checksums),
        }

    def to_json(self) -> str:
        return json.dumps(self.json_dict)

    @classmethod
    def from_json(cls, text: str | bytes) -> VersionManifest:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Mapping) -> VersionManifest:
        return cls(
            version=int(d["version"]),
            segment=str(d["segment"]),
            tensors=tuple(TensorSpec.from_dict(t) for t in d["tensors"]),
            total_bytes=int(d["total_bytes"]),
            chunk_bytes=int(d.get("chunk_bytes", 0)),
            checksums=tuple(int(c) for c in d.get("checksums", ())),
        )

    @property
    def num_chunks(self) -> int:
        return len(chunk_ranges(self.total_bytes, self.chunk_bytes)) if self.chunk_bytes else 0


def chunk_ranges(total_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """`[lo, hi)` byte ranges of the chunks of a segment; one empty chunk if it is empty."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be positive")
    bounds = list(range(0, total_bytes, chunk_bytes)) or [0]
    return [(lo, min(lo + chunk_bytes, total_bytes)) for lo in bounds]


def checksum(buf) -> int:
    """xxh3-64 of a buffer: about 20 GB/s, faster than copying it (crc32 is 3x slower)."""
    return xxhash.xxh3_64_intdigest(buf)


def segment_checksums(buf: np.ndarray, total_bytes: int, chunk_bytes: int) -> tuple[int, ...]:
    """Per-chunk checksums of the first `total_bytes` bytes of a uint8 buffer."""
    return tuple(checksum(buf[lo:hi]) for lo, hi in chunk_ranges(total_bytes, chunk_bytes))


@dataclasses.dataclass(eq=False)
class Held:
    """A version this relay holds or is filling. `buf` maps its segment; chunks below
    `ready` are written and verified, `sums` holds their checksums."""

    manifest: VersionManifest
    mm: mmap.mmap | None
    buf: np.ndarray | None  # both None once released
    sums: list[int] = dataclasses.field(default_factory=list)
    ready: int = 0
    state: str = "filling"  # then "complete" or "aborted"
    handed_off: bool = False  # published to this relay (not received from upstream)

    @property
    def version(self) -> int:
        return self.manifest.version

    def chunk(self, i: int) -> np.ndarray:
        lo, hi = chunk_ranges(self.manifest.total_bytes, self.manifest.chunk_bytes)[i]
        return self.buf[lo:hi]


def verify_version(manifest: VersionManifest) -> bool:
    """Re-read a visible version from /dev/shm and check every chunk's checksum."""
    buf = _map_for_reading(manifest)
    return segment_checksums(buf, manifest.total_bytes, manifest.chunk_bytes) == manifest.checksums


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
    """`str(dtype)`, remembered: numpy builds the name anew on every call (4 us), which a
    mixture of experts' 18,432 expert tensors pay several times a version."""
    return str(dtype)


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a dtype name; bfloat16 and float8 come from ml_dtypes.
    Remembered, like `dtype_name`: every tensor view of every pull asks."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # registers bfloat16, float8_* with numpy

        return np.dtype(getattr(ml_dtypes, name))


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_layout(
    *, version: int, segment: str, tensors: Iterable[tuple[str, tuple[int, ...], str]]
) -> VersionManifest:
    """Place `(name, shape, dtype)` tensors back to back at 64-byte aligned offsets."""
    key = tuple((str(name), tuple(int(x) for x in shape), str(dtype))
                for name, shape, dtype in tensors)
    try:
        specs, total = _plan_offsets(key)
    except ValueError as err:
        raise ValueError(f"{err} in version {version}") from None
    return VersionManifest(version=version, segment=segment, tensors=specs, total_bytes=total)


@functools.lru_cache(maxsize=16)
def _plan_offsets(tensors: tuple) -> tuple[tuple[TensorSpec, ...], int]:
    # Cached: every version of a run has the same layout, and planning one of a few
    # hundred tensors costs more than the hand-off's message.
    specs, offset, seen = [], 0, set()
    for name, shape, dtype in tensors:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize
        specs.append(
            TensorSpec(name=name, shape=shape, dtype=dtype, offset=offset, nbytes=nbytes)
        )
        offset = _align(offset + nbytes)
    return tuple(specs), offset


def create_segment(segment: str, size: int, *, populate: bool = False) -> mmap.mmap:
    """Create `/dev/shm/<segment>` of `size` bytes and map it writable.

    `populate` allocates and maps every page now. First-touch page faults on fresh tmpfs
    pages cost several times a memory copy, so relays populate segments ahead of time,
    off the broadcast's critical path.
    """
    fd = os.open(SHM_DIR / segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # mmap refuses a zero-length file, so an empty version still gets one page.
        size = max(size, ALIGNMENT)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if populate:
        # One write per page allocates and maps it, with the GIL released (numpy). Not
        # MAP_POPULATE: CPython holds the GIL through mmap(), so a relay populating a
        # segment in a thread stalled its event loop (and its broadcast) ~1 ms per MB.
        np.frombuffer(mm, np.uint8)[:: mmap.PAGESIZE] = 0
    return mm


def rename_segment(old: str, new: str) -> None:
    """Atomically give a segment a new name (a prepared spare becomes a version's)."""
    os.rename(SHM_DIR / old, SHM_DIR / new)


def unlink_segment(segment: str) -> None:
    """Remove a segment's name; existing mappings stay valid until unmapped."""
    try:
        os.unlink(SHM_DIR / segment)
    except FileNotFoundError:
        pass


def open_version(manifest: VersionManifest) -> dict[str, np.ndarray]:
    """Read-only, zero-copy views of every tensor of a version.

    The arrays keep the mapping (and the reader's lock on it) alive through their
    `.base`, so they stay valid after the relay retires the segment. Raises
    FileNotFoundError if the segment is already retired; ask the relay for its latest
    version and try again.
    """
    buf = _map_for_reading(manifest)
    return {t.name: _view(buf, t) for t in manifest.tensors}


# Read-only mappings of the segments this process has read, by (device, inode), each with
# an unlocked descriptor of its own. A relay recycles a few segments (spare -> version ->
# retired -> spare), so a reader that keeps them mapped maps each once: mapping 10 MB of
# 4 KiB pages costs about as much as copying it. The lock, not the mapping, keeps a
# segment from being reused, so a mapping kept here does not hold up the relay.
_MAPPED: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}
_MAPPED_MAX = 4
_MAPPED_LOCK = threading.Lock()


def _map_for_reading(manifest: VersionManifest) -> np.ndarray:
    """A read-only uint8 array over a version's segment, under a shared lock that is held
    while the array (or any view of it) lives."""
    path = SHM_DIR / manifest.segment
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileNotFoundError(f"segment {manifest.segment} is being reused") from None
        # Renamed between our open and our lock: the file may be a spare the writer
        # fills with another version.
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(f"segment {manifest.segment} was retired")
        size = os.fstat(fd).st_size
        if size < manifest.total_bytes:
            raise ValueError(
                f"segment {manifest.segment} holds {size} bytes, "
                f"manifest of version {manifest.version} needs {manifest.total_bytes}"
            )
        with _MAPPED_LOCK:
            buf = np.frombuffer(_mapping(fd), np.uint8)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(buf, os.close, fd)  # closing the descriptor releases the lock
    return buf


def _mapping(locked_fd: int) -> mmap.mmap:
    """The cached mapping of the segment open as `locked_fd`, mapped now if need be."""
    st = os.fstat(locked_fd)
    key = (st.st_dev, st.st_ino)
    for other, (fd, mm) in list(_MAPPED.items()):
        # A segment the relay unlinked would keep its pages alive here: let it go.
        if other != key and os.fstat(fd).st_nlink == 0:
            _forget(other)
    entry = _MAPPED.pop(key, None)  # popped and put back: the dict is in LRU order
    if entry is not None and len(entry[1]) != st.st_size:
        _MAPPED[key] = entry
        _forget(key)
        entry = None
    if entry is None:
        # A descriptor of our own (a new open file description, so not sharing the
        # lock), which mmap also duplicates: the cached mapping never holds the lock.
        fd = os.open(f"/proc/self/fd/{locked_fd}", os.O_RDONLY)
        try:
            # PROT_READ makes the buffer read-only, so numpy views refuse writes; POPULATE
            # maps every page at once, 2-3x faster than faulting them in one by one.
            entry = (fd, mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                   prot=mmap.PROT_READ))
        except BaseException:
            os.close(fd)
            raise
    _MAPPED[key] = entry
    while len(_MAPPED) > _MAPPED_MAX:
        _forget(next(iter(_MAPPED)))
    return entry[1]


def _forget(key: tuple[int, int]) -> None:
    fd, mm = _MAPPED.pop(key)
    os.close(fd)
    try:
        mm.close()
    except BufferError:  # arrays still use it: the mapping goes with the last of them
        pass


def has_readers(segment: str) -> bool:
    """True if some reader maps `segment` (or is about to): its shared lock is held."""
    fd = os.open(SHM_DIR / segment, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases our lock, if we got it


# An inbox slot (the trainer's hand-off segment) ends in two int64 marks: the version its
# writer last finished writing, and the version the relay last took (locked to copy out).
SLOT_TAIL = ALIGNMENT
SLOT_WRITTEN, SLOT_TAKEN = 0, 1


def slot_marks(mm: mmap.mmap) -> np.ndarray:
    """The `[written, taken]` marks at the end of an inbox slot's mapping."""
    return np.frombuffer(mm, np.int64, count=2, offset=len(mm) - SLOT_TAIL)


def tensor_views(mm: mmap.mmap, manifest: VersionManifest) -> dict[str, np.ndarray]:
    """Views of every tensor of `manifest` inside a mapping (writable if the mapping is)."""
    buf = np.frombuffer(mm, np.uint8)
    return {t.name: _view(buf, t) for t in manifest.tensors}


def _view(buf: np.ndarray, spec: TensorSpec) -> np.ndarray:
    dtype = numpy_dtype(spec.dtype)
    if spec.nbytes == 0:  # frombuffer rejects an offset at the very end of the buffer
        view = np.zeros(spec.shape, dtype)
        view.flags.writeable = False
        return view
    return buf[spec.offset : spec.offset + spec.nbytes].view(dtype).reshape(spec.shape)
