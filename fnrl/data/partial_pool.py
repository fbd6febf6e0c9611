"""The partial response pool (Laminar seed 000 §3.1): every streamed token and its
behaviour log-prob, kept durably, so an interrupt, a migration or a crash loses nothing.

On disk it is an append-only log of records; in memory, the replayed state. A record is

    u32 payload length | u32 CRC-32 of payload | payload (JSON, UTF-8)

and the payload is one of
    {"op": "start",  "uid", "prompt"}             a trajectory enters the pool
    {"op": "tokens", "uid", "v", "ids", "lps"}    tokens streamed under version v
                                                  ("fed": true: ids fed, not sampled)
    {"op": "finish", "uid", "reason"}             generation ended
    {"op": "drop",   "uid"}                       consumed or aborted: forget it
JSON keeps Python floats exact (repr round-trips), so the log-probs the loss later
uses are bit-identical to what the engine sent. Opening replays the log; a torn last
record (a crash mid-write: short header, short payload or bad CRC) is cut off, and
nothing before it is lost. `compact` rewrites only the live trajectories.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fnrl.shell.files import write_atomic
from fnrl.types import Segment

_HEADER = struct.Struct("<II")


@dataclass(frozen=True)
class PartialResponse:
    uid: str
    prompt_ids: tuple[int, ...]
    segments: tuple[Segment, ...]   # consecutive tokens of one version form one segment
    finish_reason: str | None       # None while still generating

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


class PartialResponsePool:
    """One log file, one writer. `fsync=True` makes each record survive a power cut,
    not just a process crash (the default flushes to the OS, which survives the latter)."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync
        self._items: dict[str, PartialResponse] = {}
        self.recovered_bytes_dropped = self._replay()
        self._file = open(self.path, "ab")

    # --- writing -------------------------------------------------------------------

    def start(self, uid: str, prompt_ids: Sequence[int]) -> None:
        if uid in self._items:
            raise ValueError(f"trajectory {uid!r} is already in the pool")
        self._write({"op": "start", "uid": uid, "prompt": [int(t) for t in prompt_ids]})

    def append(self, uid: str, version: int, token_ids: Sequence[int],
               logprobs: Sequence[float], *, fed: bool = False) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs")
        if uid not in self._items:
            raise KeyError(f"trajectory {uid!r} was never started")
        if self._items[uid].finish_reason is not None:
            raise ValueError(f"trajectory {uid!r} is finished")
        record = {"op": "tokens", "uid": uid, "v": int(version),
                  "ids": [int(t) for t in token_ids], "lps": [float(x) for x in logprobs]}
        if fed:   # only multi-turn records carry the key: single-turn logs are unchanged
            record["fed"] = True
        self._write(record)

    def finish(self, uid: str, reason: str) -> None:
        if uid not in self._items:
            raise KeyError(f"trajectory {uid!r} was never started")
        self._write({"op": "finish", "uid": uid, "reason": str(reason)})

    def drop(self, uid: str) -> None:
        if uid in self._items:
            self._write({"op": "drop", "uid": uid})

    # --- reading -------------------------------------------------------------------

    def get(self, uid: str) -> PartialResponse:
        return self._items[uid]

    def live(self) -> tuple[str, ...]:
        """Trajectories in the pool, in the order they started."""
        return tuple(self._items)

    def __contains__(self, uid: str) -> bool:
        return uid in self._items

    def __len__(self) -> int:
        return len(self._items)

    # --- maintenance -----------------------------------------------------------------

    def compact(self) -> None:
        """Rewrite the log with only live trajectories; atomic (write, fsync, rename)."""
        records = []
        for item in self._items.values():
            records.append(_encode({"op": "start", "uid": item.uid, "prompt": list(item.prompt_ids)}))
            for s in item.segments:
                records.append(_encode({"op": "tokens", "uid": item.uid, "v": s.version,
                                        "ids": list(s.token_ids), "lps": list(s.logprobs),
                                        **({"fed": True} if s.fed else {})}))
            if item.finish_reason is not None:
                records.append(_encode({"op": "finish", "uid": item.uid,
                                        "reason": item.finish_reason}))
        self._file.close()
        write_atomic(self.path, b"".join(records), fsync=True)
        self._file = open(self.path, "ab")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "PartialResponsePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------

    def _write(self, record: dict) -> None:
        self._file.write(_encode(record))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._apply(record)

    def _apply(self, r: dict) -> None:
        uid, op = r["uid"], r["op"]
        if op == "start":
            self._items[uid] = PartialResponse(uid, tuple(r["prompt"]), (), None)
        elif op == "tokens":
            item = self._items[uid]
            segs = item.segments
            new = Segment(r["v"], tuple(r["ids"]), tuple(r["lps"]), bool(r.get("fed", False)))
            if segs and (segs[-1].version, segs[-1].fed) == (new.version, new.fed):
                last = segs[-1]
                new = Segment(last.version, last.token_ids + new.token_ids,
                              last.logprobs + new.logprobs, last.fed)
                segs = segs[:-1]
            self._items[uid] = PartialResponse(uid, item.prompt_ids, segs + (new,), None)
        elif op == "finish":
            item = self._items[uid]
            self._items[uid] = PartialResponse(uid, item.prompt_ids, item.segments, r["reason"])
        elif op == "drop":
            self._items.pop(uid, None)

    def _replay(self) -> int:
        """Rebuild from the log; cut a torn tail. Returns the bytes cut."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        pos = 0
        while pos + _HEADER.size <= len(data):
            size, crc = _HEADER.unpack_from(data, pos)
            end = pos + _HEADER.size + size
            payload = data[pos + _HEADER.size:end]
            if end > len(data) or zlib.crc32(payload) != crc:
                break
            self._apply(json.loads(payload))
            pos = end
        if pos < len(data):
            # Only the last record can be torn: records are appended whole and flushed in
            # order, so anything after the first bad one was never acknowledged.
            with open(self.path, "r+b") as f:
                f.truncate(pos)
        return len(data) - pos


def _encode(record: dict) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
