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
    """(the record, "") or (None, why it is not one), for a whole line (its end of line
    included)."""
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


def _scan(path: Path) -> tuple[list[tuple[int, dict | None, str]], int, int]:
    """(offset, record or None, why) of every whole line of `path`, the length of those
    lines, and the length of the torn tail: a last line with no end of line, all a crash
    can leave (zeros of a power loss included). A whole line that fails its check was
    damaged, even the last: a flipped end of line fuses two records into one bad line,
    and taking that for a torn tail would drop both."""
    lines, offset = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):   # only the last line can lack one
                return lines, offset, len(line)
            lines.append((offset, *_parse(line)))
            offset += len(line)
    return lines, offset, 0


def read(path: Path) -> Read:
    """Every record of `path` ([] if it does not exist). A last line cut short (no end of
    line) is a torn tail: dropped. Any other bad record raises `DamagedRecord`."""
    path = Path(path)
    if not path.exists():
        return Read([], [], 0)
    lines, good, torn = _scan(path)
    for index, (offset, record, why) in enumerate(lines):
        if record is None:
            valid_after = sum(r is not None for _, r, _ in lines[index + 1:])
            raise DamagedRecord(path, offset, index, why, valid_after)
    return Read([r for _, r, _ in lines], [at for at, _, _ in lines], good, torn)


def read_skipping(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """For report logs, where a lost record costs a figure, not a group trained twice:
    every valid record, and (byte offset, reason) of each damaged one, skipped. A torn
    tail (a last line cut short) is dropped and not listed."""
    path = Path(path)
    if not path.exists():
        return [], []
    lines, _, _ = _scan(path)
    return ([r for _, r, _ in lines if r is not None],
            [(at, why) for at, r, why in lines if r is None])


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
