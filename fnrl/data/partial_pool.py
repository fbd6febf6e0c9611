"""The partial response pool (Laminar seed 000 §3.1): every streamed token and its
behaviour log-prob, kept durably, so an interrupt, a migration or a crash loses nothing.

On disk it is an append-only log of records; in memory, the replayed state. A record is

    u32 payload length | u32 CRC-32 of payload | payload (JSON, UTF-8)

and the payload is one of
    {"op": "start",  "uid", "prompt"}             a trajectory enters the pool
    {"op": "tokens", "uid", "v", "ids", "lps"}    tokens streamed under version v
                                                  ("fed": true: ids fed, not sampled)
    {"op": "routes", "uid", "from", "routes"}     rollout routing replay (a mixture of
                                                  experts): the engine's routes of the
                                                  positions (prompt + response) from
                                                  "from" on (fnrl.types.Routes.to_json)
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
from fnrl.types import Routes, Segment

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
    routes: Routes | None = None
    """Routing replay: the engine's routes of the first positions of prompt + response,
    each as first reported (a request reports from the first position not yet covered)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def positions(self) -> int:
        """Prompt + response tokens: the positions routes are recorded for."""
        return len(self.prompt_ids) + self.num_tokens

    def trajectory_routes(self) -> Routes | None:
        """The routes a Trajectory of this item carries: every position's, the last
        token's (never fed to the engine, only a target) as expert 0. None when any other
        position has none (not recorded, or a request cut off before it reported)."""
        if self.routes is None or len(self.routes) < self.positions - 1:
            return None
        return self.routes[:self.positions].padded(self.positions)


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

    def start(self, uid: str, prompt_ids: Sequence[int]) -> None:
        if uid in self._items:
            raise ValueError(f"trajectory {uid!r} is already in the pool")
        self._write({"op": "start", "uid": uid, "prompt": [int(t) for t in prompt_ids]})

    def append(self, uid: str, version: int, token_ids: Sequence[int],
               logprobs: Sequence[float], *, fed: bool = False) -> None:
        """Tokens streamed under `version` (`fed`: fed to the model, not sampled)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs")
        self._live(uid)
        record = {"op": "tokens", "uid": uid, "v": int(version),
                  "ids": [int(t) for t in token_ids], "lps": [float(x) for x in logprobs]}
        if fed:   # only multi-turn records carry the key: single-turn logs are unchanged
            record["fed"] = True
        self._write(record)

    def routes_covered(self, uid: str) -> int:
        """How many positions (prompt + response, from the first) have routes recorded:
        where a request for `uid` asks the engine to report routes from."""
        routes = self._live(uid).routes
        return 0 if routes is None else len(routes)

    def add_routes(self, uid: str, start: int, routes: Routes) -> int:
        """Records the engine's routes of positions `start`.. of `uid`'s prompt + response
        (a request's report, `StreamChunk.routes`); positions already covered keep the
        routes first reported (a continued request re-prefills them, perhaps under a
        newer version). Returns how many positions were added. ValueError when the report
        starts past the covered positions (a gap), or covers positions the trajectory
        does not have."""
        item = self._live(uid)
        covered = 0 if item.routes is None else len(item.routes)
        positions = item.positions
        if start > covered or start + len(routes) > positions:
            raise ValueError(f"trajectory {uid!r}: routes for positions {start}.."
                             f"{start + len(routes) - 1}, but {covered} of its {positions} "
                             "positions are covered (a report starts at or before the first "
                             "uncovered one and ends within the trajectory)")
        new = routes[covered - start:]
        if not len(new):
            return 0
        if item.routes is not None and (new.layers, new.top_k) != (item.routes.layers,
                                                                   item.routes.top_k):
            raise ValueError(f"trajectory {uid!r}: routes of {new.layers} layers x top_k "
                             f"{new.top_k} after {item.routes.layers} x {item.routes.top_k}")
        self._write({"op": "routes", "uid": uid, "from": covered, "routes": new.to_json()})
        return len(new)

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
                                           "prompt": list(item.prompt_ids)}))
            for s in item.segments:
                records.append(self._numbered({"op": "tokens", "uid": item.uid, "v": s.version,
                                               "ids": list(s.token_ids), "lps": list(s.logprobs),
                                               **({"fed": True} if s.fed else {})}))
            if item.routes is not None:
                records.append(self._numbered({"op": "routes", "uid": item.uid, "from": 0,
                                               "routes": item.routes.to_json()}))
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
            self._items[uid] = PartialResponse(uid, tuple(r["prompt"]), (), None)
        elif op == "routes":
            item = self._items[uid]
            new = Routes.from_json(r["routes"])
            old = item.routes[:int(r["from"])] if item.routes is not None else None
            self._items[uid] = replace(item, routes=new if old is None else old + new)
        elif op == "tokens":
            item = self._items[uid]
            segs = item.segments
            new = Segment(r["v"], tuple(r["ids"]), tuple(r["lps"]), bool(r.get("fed", False)))
            # Fed segments stay whole: one per environment step (a resumed episode
            # pairs each with its step's info).
            if segs and not new.fed and (segs[-1].version, segs[-1].fed) == (new.version, False):
                last = segs[-1]
                new = Segment(last.version, last.token_ids + new.token_ids,
                              last.logprobs + new.logprobs, last.fed)
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


def _encode(record: dict) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
