"""The partial response pool (Laminar seed 000 §3.1): every streamed token and its
behaviour log-prob, kept durably, so an interrupt, a migration or a crash loses nothing.

On disk it is an append-only log of records; in memory, the replayed state. A record is

    u32 payload length | u32 CRC-32 of payload | payload (JSON, UTF-8)

and the payload is one of
    {"op": "start",  "uid", "prompt"}             a trajectory enters the pool
    {"op": "tokens", "uid", "v", "ids", "lps"}    tokens streamed under version v
                                                  ("fed": true: ids fed, not sampled)
    {"op": "prompt_routes", "uid", "routes"}      the engine's routes of the prompt
and, under rollout routing replay (a mixture of experts), "tokens" (and "start") carry
"routes" (and "prompt_routes"): per token, per layer, the experts the engine chose, as
nested JSON lists. A log without them reads as a run without routes.
    {"op": "finish", "uid", "reason"}             generation ended (multi-turn: with
                                                  "outcome", the environment's grade)
    {"op": "drop",   "uid"}                       consumed or aborted: forget it
and, for multi-turn episodes (fnrl.control.episodes), the turn boundaries:
    {"op": "turn_end", "uid"}                     a sampled turn ended: its action is
                                                  due to the environment (a tool call)
    {"op": "env_step", "uid", "info"}             the environment stepped on it; the
                                                  observation follows as fed tokens
Every payload also carries "n", its trajectory's record count so far, so a missing
record shows as a gap in its own trajectory. JSON keeps Python floats exact (repr
round-trips), so the log-probs the loss later uses are bit-identical to what the engine
sent. `compact` rewrites only the live trajectories.

Opening replays the log. A torn last record (a crash mid-write: short header, short
payload or bad CRC with nothing valid after it) is cut off, and nothing before it is
lost. A bad record with valid ones after it is damage in the middle: the reader finds the
next valid record (a header whose CRC holds over a JSON payload), replays everything
after it, and discards only the trajectories the damage broke: those with a gap in their
"n" (or whose start was lost). They are regenerated from their prompts; every other
trajectory, before or after the damage, is kept. A log written before "n" existed cannot
say which trajectory the damage hit: every trajectory live at that point is discarded.
The damaged file is kept beside the log (`<log>.damaged`), the log is compacted, and
`recovery` says what was dropped.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from fnrl.shell.files import write_atomic
from fnrl.types import Routes, Segment, check_routes, concat_routes

_HEADER = struct.Struct("<II")


@dataclass(frozen=True)
class PoolRecovery:
    """What opening the pool dropped: a torn tail, and damage in the middle with the
    trajectories it broke (discarded whole) and their tokens."""

    torn_bytes: int = 0
    damaged_bytes: int = 0
    damaged_offsets: tuple[int, ...] = ()
    discarded_uids: tuple[str, ...] = ()
    discarded_tokens: int = 0

    def describe(self, path) -> str:
        return (f"{path}: damaged at byte(s) {list(self.damaged_offsets)} "
                f"({self.damaged_bytes} bytes unreadable); {len(self.discarded_uids)} "
                f"trajectories it broke discarded ({self.discarded_tokens} tokens, to be "
                f"generated again), every other one kept; the damaged file is kept as "
                f"{path}.damaged")


@dataclass(frozen=True)
class PartialResponse:
    uid: str
    prompt_ids: tuple[int, ...]
    segments: tuple[Segment, ...]   # consecutive tokens of one version form one segment
    finish_reason: str | None       # None while still generating
    env_steps: tuple[dict[str, Any], ...] = ()
    """Multi-turn: the info of each environment step taken (the observations fed)."""
    turn_closed: bool = False
    """Multi-turn: the last sampled turn ended and its environment step is pending (a
    tool call in flight when the trajectory was cut off)."""
    outcome: dict[str, Any] | None = None
    """Multi-turn: the finished episode's reward and tool facts, so a restarted
    controller rewards it as the environment graded it."""
    prompt_routes: Routes | None = None
    """Routing replay: the engine's routes of the prompt tokens, as first reported."""

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
        self._counts: dict[str, int] = {}   # records written per trajectory ("n")
        self.recovery = self._replay()
        self.recovered_bytes_dropped = self.recovery.torn_bytes + self.recovery.damaged_bytes
        self._file = open(self.path, "ab")
        if self.recovery.damaged_bytes:
            self.compact()   # the damage is read once: the log from here on is whole

    # --- writing -------------------------------------------------------------------

    def start(self, uid: str, prompt_ids: Sequence[int], *,
              prompt_routes: Routes | None = None) -> None:
        if uid in self._items:
            raise ValueError(f"trajectory {uid!r} is already in the pool")
        check_routes(prompt_routes, len(prompt_ids), f"trajectory {uid!r}'s prompt")
        record = {"op": "start", "uid": uid, "prompt": [int(t) for t in prompt_ids]}
        if prompt_routes is not None:
            record["prompt_routes"] = _routes_json(prompt_routes)
        self._write(record)

    def set_prompt_routes(self, uid: str, routes: Routes) -> bool:
        """Records the engine's routes of the prompt, unless some are already recorded
        (returns whether it wrote). The first placement's are kept: a continued request
        re-prefills the prompt, perhaps under a newer version, and reports it again."""
        item = self._live(uid)
        if item.prompt_routes is not None:
            return False
        check_routes(routes, len(item.prompt_ids), f"trajectory {uid!r}'s prompt")
        self._write({"op": "prompt_routes", "uid": uid, "routes": _routes_json(routes)})
        return True

    def append(self, uid: str, version: int, token_ids: Sequence[int],
               logprobs: Sequence[float], *, fed: bool = False,
               routes: Routes | None = None) -> None:
        """Tokens streamed under `version`; `routes`: per token, the engine's experts
        (routing replay). A trajectory's tokens all carry routes or none do."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs")
        check_routes(routes, len(token_ids), f"trajectory {uid!r}'s tokens")
        item = self._live(uid)
        # Checked before the write: a record the replay could not merge would make the
        # log unreadable on the next open.
        if item.segments and (item.segments[-1].routes is None) != (routes is None):
            raise ValueError(f"trajectory {uid!r}: {len(token_ids)} tokens "
                             f"{'without' if routes is None else 'with'} routes after "
                             f"{item.num_tokens} {'with' if routes is None else 'without'}")
        record = {"op": "tokens", "uid": uid, "v": int(version),
                  "ids": [int(t) for t in token_ids], "lps": [float(x) for x in logprobs]}
        if fed:   # only multi-turn records carry the key: single-turn logs are unchanged
            record["fed"] = True
        if routes is not None:
            record["routes"] = _routes_json(routes)
        self._write(record)

    def finish(self, uid: str, reason: str, *, outcome: dict[str, Any] | None = None) -> None:
        if uid not in self._items:
            raise KeyError(f"trajectory {uid!r} was never started")
        self._write({"op": "finish", "uid": uid, "reason": str(reason),
                     **({"outcome": outcome} if outcome is not None else {})})

    def end_turn(self, uid: str) -> None:
        """A multi-turn episode's sampled turn ended (its action goes to the environment)."""
        self._live(uid)
        self._write({"op": "turn_end", "uid": uid})

    def env_step(self, uid: str, info: dict[str, Any]) -> None:
        """The environment stepped on the last turn's action (its observation is appended
        next, fed); `info` (JSON) is what a resumed environment is restored from."""
        self._live(uid)
        self._write({"op": "env_step", "uid": uid, "info": info})

    def _live(self, uid: str) -> PartialResponse:
        if uid not in self._items:
            raise KeyError(f"trajectory {uid!r} was never started")
        if self._items[uid].finish_reason is not None:
            raise ValueError(f"trajectory {uid!r} is finished")
        return self._items[uid]

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
        self._counts = {}
        for item in self._items.values():
            records.append(self._numbered({"op": "start", "uid": item.uid,
                                           "prompt": list(item.prompt_ids),
                                           **_routes_field("prompt_routes", item.prompt_routes)}))
            for s in item.segments:
                records.append(self._numbered({"op": "tokens", "uid": item.uid, "v": s.version,
                                               "ids": list(s.token_ids), "lps": list(s.logprobs),
                                               **({"fed": True} if s.fed else {}),
                                               **_routes_field("routes", s.routes)}))
            # Steps after the tokens: the pending-turn flag is the last record's state.
            records += [self._numbered({"op": "env_step", "uid": item.uid, "info": info})
                        for info in item.env_steps]
            if item.turn_closed:
                records.append(self._numbered({"op": "turn_end", "uid": item.uid}))
            if item.finish_reason is not None:
                records.append(self._numbered({"op": "finish", "uid": item.uid,
                                               "reason": item.finish_reason,
                                               **({"outcome": item.outcome}
                                                  if item.outcome is not None else {})}))
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

    def _numbered(self, record: dict) -> bytes:
        """`record` encoded with its trajectory's record count ("n")."""
        uid = record["uid"]
        n = self._counts.get(uid, 0)
        self._counts[uid] = n + 1
        return _encode({**record, "n": n})

    def _write(self, record: dict) -> None:
        self._file.write(self._numbered(record))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._apply(record)

    def _apply(self, r: dict) -> None:
        uid, op = r["uid"], r["op"]
        if op == "start":
            self._items[uid] = PartialResponse(uid, tuple(r["prompt"]), (), None,
                                               prompt_routes=_routes(r.get("prompt_routes")))
        elif op == "prompt_routes":
            self._items[uid] = replace(self._items[uid], prompt_routes=_routes(r["routes"]))
        elif op == "tokens":
            item = self._items[uid]
            segs = item.segments
            new = Segment(r["v"], tuple(r["ids"]), tuple(r["lps"]), bool(r.get("fed", False)),
                          _routes(r.get("routes")))
            # Fed segments stay whole: one per environment step (a resumed episode
            # pairs each with its step's info).
            if segs and not new.fed and (segs[-1].version, segs[-1].fed) == (new.version, False):
                last = segs[-1]
                new = Segment(last.version, last.token_ids + new.token_ids,
                              last.logprobs + new.logprobs, last.fed,
                              concat_routes((last.routes, new.routes), f"trajectory {uid!r}"))
                segs = segs[:-1]
            self._items[uid] = replace(item, segments=segs + (new,), turn_closed=False)
        elif op == "turn_end":
            self._items[uid] = replace(self._items[uid], turn_closed=True)
        elif op == "env_step":
            item = self._items[uid]
            self._items[uid] = replace(item, env_steps=item.env_steps + (r["info"],),
                                       turn_closed=False)
        elif op == "finish":
            self._items[uid] = replace(self._items[uid], finish_reason=r["reason"],
                                       outcome=r.get("outcome"))
        elif op == "drop":
            self._items.pop(uid, None)
            self._counts.pop(uid, None)

    def _replay(self) -> PoolRecovery:
        """Rebuild from the log: cut a torn tail, step over damage in the middle (see
        the module's docstring). Returns what was dropped."""
        if not self.path.exists():
            return PoolRecovery()
        data = self.path.read_bytes()
        pos, damaged_bytes, offsets = 0, 0, []
        expected: dict[str, int] = {}     # the next "n" of each trajectory
        broken: set[str] = set()          # trajectories the damage broke
        numbered = False                  # records carry "n" (not a log from before it)
        while pos + _HEADER.size <= len(data):
            record = _decode(data, pos)
            if record is None:
                resume = _next_record(data, pos + 1)
                if resume is None:
                    break                 # nothing valid after it: a torn tail
                offsets.append(pos)
                damaged_bytes += resume - pos
                if not numbered:
                    broken.update(self._items)   # an old log: cannot say which; all live
                pos = resume
                continue
            payload, end = record
            uid = payload["uid"]
            n = payload.get("n")
            numbered = numbered or n is not None
            if n is not None:
                if payload["op"] == "start":
                    expected[uid] = 0
                if expected.get(uid) != n:
                    broken.add(uid)       # a record of it was lost (or its start)
                expected[uid] = n + 1
            if uid not in broken and (payload["op"] == "start" or uid in self._items):
                self._apply(payload)
                self._counts[uid] = n + 1 if n is not None else self._counts.get(uid, 0) + 1
            pos = end
        torn = len(data) - pos
        if torn:
            # Only the last record can be torn: records are appended whole and flushed in
            # order, so anything after the first bad one was never acknowledged.
            with open(self.path, "r+b") as f:
                f.truncate(pos)
        if not offsets:
            return PoolRecovery(torn_bytes=torn)
        self.path.with_name(self.path.name + ".damaged").write_bytes(data)
        gone = [uid for uid in self._items if uid in broken]
        tokens = sum(self._items[uid].num_tokens for uid in gone)
        for uid in gone:
            self._items.pop(uid)
            self._counts.pop(uid, None)
        return PoolRecovery(torn_bytes=torn, damaged_bytes=damaged_bytes,
                            damaged_offsets=tuple(offsets), discarded_uids=tuple(gone),
                            discarded_tokens=tokens)



def _decode(data: bytes, pos: int) -> tuple[dict, int] | None:
    """(payload, end) of a valid record at `pos`, or None."""
    if pos + _HEADER.size > len(data):
        return None
    size, crc = _HEADER.unpack_from(data, pos)
    end = pos + _HEADER.size + size
    if end > len(data):
        return None
    payload = data[pos + _HEADER.size:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or "uid" not in record or "op" not in record:
        return None
    return record, end


def _next_record(data: bytes, pos: int) -> int | None:
    """The offset of the first valid record at or after `pos`, or None: where reading
    goes on after damage (a CRC over a JSON payload does not hold by chance)."""
    for p in range(pos, len(data) - _HEADER.size + 1):
        if _decode(data, p) is not None:
            return p
    return None


def _routes_json(routes: Routes) -> list:
    """Nested lists of ints (numpy integers included) for the JSON payload."""
    return [[[int(e) for e in layer] for layer in token] for token in routes]


def _routes_field(key: str, routes: Routes | None) -> dict:
    """`{key: routes}` for a record, or nothing: logs without routes stay as they were."""
    return {} if routes is None else {key: _routes_json(routes)}


def _routes(obj: list | None) -> Routes | None:
    """A record's routes as nested tuples (absent: None, as in logs from before them)."""
    if obj is None:
        return None
    return tuple(tuple(tuple(layer) for layer in token) for token in obj)


def _encode(record: dict) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
