"""Framed JSON lines: an append-only log whose reader can tell a torn tail from damage.

Each record is one line, its CRC-32 in 8 hex digits, a space, then the JSON object:

    3f1a09c2 {"ev": "fill", ...}

A crash can only cut the last record short (a write that never finished, so a last line
with no end of line): the reader drops that torn tail, the writer cuts it off before
appending again, and nothing after it existed. Any other record that fails its check is
damage (a bad disk, a stray write): dropping it or cutting the log there would silently
lose it and what came after, so reading raises `DamagedRecord`, naming the file, the byte
offset, the record's index and how many valid records follow, and the caller decides.
What the write-ahead logs of databases do (PostgreSQL's WAL, Kafka's segments, both with
a CRC per record), kept readable: `cut -d' ' -f2- FILE | jq` prints the records.

Lines without a frame that parse as a JSON object are read as records too: logs written
before framing (the same run resumed by a newer fnrl).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

__all__ = ["DamagedRecord", "Read", "append", "frame", "read", "read_skipping"]


class DamagedRecord(ValueError):
    """A record in the middle of a log fails its check: named, with what follows it."""

    def __init__(self, path: Path, offset: int, index: int, reason: str, valid_after: int,
                 advice: str = ""):
        self.path, self.offset, self.index = Path(path), offset, index
        self.reason, self.valid_after = reason, valid_after
        super().__init__(f"{path}: record {index} at byte {offset} is damaged ({reason}) and "
                         f"{valid_after} valid record(s) follow it: the file was damaged, "
                         "not cut short by a crash" + (f". {advice}" if advice else ""))

    def advised(self, advice: str) -> DamagedRecord:
        """The same error, saying what the file's owner can do about it."""
        return DamagedRecord(self.path, self.offset, self.index, self.reason,
                             self.valid_after, advice)


@dataclasses.dataclass(frozen=True)
class Read:
    """A log's records in order, their byte offsets, and the torn tail dropped."""

    records: list[dict]
    offsets: list[int]
    good_bytes: int           # the records' span: where a writer appends
    torn_bytes: int = 0       # the bytes after it (a crash's cut-off record), dropped


def frame(record: dict) -> str:
    """`record` as one framed line, newline included."""
    body = json.dumps(record)
    return f"{zlib.crc32(body.encode()):08x} {body}\n"


def _parse(line: bytes) -> tuple[dict | None, str]:
    """(the record, "") or (None, why it is not one)."""
    if not line.endswith(b"\n"):
        return None, "no end of line"
    text = line[:-1]
    if len(text) > 9 and text[8:9] == b" " and not text.startswith(b"{"):
        body = text[9:]
        try:
            want = int(text[:8], 16)
        except ValueError:
            return None, "no checksum"
        if zlib.crc32(body) != want:
            return None, "checksum mismatch"
    else:
        body = text   # unframed: a log written before framing
    try:
        record = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "not JSON"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    return record, ""


def read(path: Path) -> Read:
    """Every record of `path` ([] if it does not exist). A last line cut short (no end of
    line) is a torn tail: dropped. Any other bad record raises `DamagedRecord`."""
    path = Path(path)
    if not path.exists():
        return Read([], [], 0)
    records, offsets = [], []
    offset = 0
    bad: tuple[int, int, str] | None = None   # (offset, index, reason) of the first bad line
    valid_after = 0
    with open(path, "rb") as f:
        for line in f:
            record, why = _parse(line)
            if record is None and bad is None:
                bad = (offset, len(records), why)
            elif record is not None and bad is not None:
                valid_after += 1
            elif record is not None:
                records.append(record)
                offsets.append(offset)
            offset += len(line)
    # A crash cuts only the last record short: one line, with no end of line. A bad line
    # that ends (or any bad line with more after it) was damaged: a flipped end of line
    # fuses two records into one bad line, and taking that for a torn tail would drop both.
    if bad is not None and (valid_after or b"\n" in _tail_from(path, bad[0])):
        raise DamagedRecord(path, bad[0], bad[1], bad[2], valid_after)
    good = bad[0] if bad is not None else offset
    return Read(records, offsets, good, offset - good)


def _tail_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def read_skipping(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """For report logs, where a lost record costs a figure, not a group trained twice:
    every valid record, and (byte offset, reason) of each damaged one, skipped. A torn
    tail (a last line cut short) is dropped and not listed."""
    path = Path(path)
    if not path.exists():
        return [], []
    records, bad = [], []
    offset, line = 0, b""
    with open(path, "rb") as f:
        for line in f:
            record, why = _parse(line)
            if record is None:
                bad.append((offset, why))
            else:
                records.append(record)
            offset += len(line)
    if bad and not line.endswith(b"\n") and bad[-1][0] == offset - len(line):
        bad.pop()   # the last line cut short: the torn tail a crash leaves
    return records, bad


def append(path: Path):
    """`path` opened to append lines (line-buffered text), after cutting off a torn last
    line: one without its end of line, left by a crash or a full disk. A line appended
    after the fragment would fuse with it into one damaged record in the middle."""
    path = Path(path)
    if path.exists():
        with open(path, "r+b") as f:
            f.truncate(_whole_lines(f))
    return open(path, "a", buffering=1)


def _whole_lines(f, chunk: int = 1 << 20) -> int:
    """The length of `f` up to and including its last end of line (0 if it has none)."""
    end = f.seek(0, 2)
    pos = end
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        block = f.read(pos - start)
        if pos == end and block.endswith(b"\n"):
            return end
        cut = block.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        pos = start
    return 0
