"""What a restarted controller rebuilds, and the accounting that makes it exact.

`ConsumedLog` writes one line per consumed group to trajectories.jsonl (the run's
accounting by id) before its tokens leave the partial response pool. `recover` reads
the journal (fnrl.control.journal) and the pool a previous controller of the run left
and puts every outstanding group back where it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from fnrl.control.book import Book, TaskIO
from fnrl.control.journal import Journal, Replayed
from fnrl.control.trajectories import TrajectoryTable
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.policy import staleness as st
from fnrl.policy.schedule import ScheduleState
from fnrl.shell.records import DamagedRecord, append
from fnrl.types import Problem


class ConsumedLog:
    """Accounting by id: one line per consumed group; its tokens leave the pool once the
    journal records the step trained (`release`).

    A crash (or a full disk) can stop the controller between a step's lines and its
    journal record. The next controller reconciles the two (`reconcile`): lines of
    groups the restored trainer holds are kept and not written again; lines of groups it
    does not hold are cut off (those groups train again, from their tokens, still in the
    pool)."""

    def __init__(self, path: Path, pool: PartialResponsePool):
        self.pool, self.path = pool, Path(path)
        self._f = append(path)   # a torn last line cut off first
        self.logged: dict[str, int] = dict(_logged_groups(self.path))   # group -> offset

    def reconcile(self, consumed: frozenset[str]) -> int:
        """Cuts off the lines of groups not in `consumed` (the journal's, after the
        trainer's restore) and returns how many. They can only be the last step's, at
        the end of the file: one such line followed by a consumed group's is damage,
        refused with the file and offset named (cutting there would lose that line)."""
        stray = sorted((at, name) for name, at in self.logged.items() if name not in consumed)
        if not stray:
            return 0
        cut = stray[0][0]
        after = [name for name, at in self.logged.items() if at > cut and name in consumed]
        if after:
            raise DamagedRecord(
                self.path, cut, sorted(self.logged.values()).index(cut),
                f"group {stray[0][1]} is logged as consumed but the journal has no step "
                f"that trained it, and {len(after)} trained group(s) follow it", len(after))
        self._f.flush()
        os.truncate(self.path, cut)
        for _, name in stray:
            del self.logged[name]
        return len(stray)

    def release(self, trajectories) -> None:
        """Drops a consumed group's tokens from the pool (after its step's journal record)."""
        for tr in trajectories:
            self.pool.drop(tr.uid)

    def log(self, name: str, version: int, trajectories, **extra) -> None:
        # The exact prompt ids each trajectory was generated from (chat template, system
        # prompt and all), so what a group trained on can be inspected and re-tokenised,
        # and every response token with its behaviour log-prob and the reward: what
        # `fnrl.experiments.replay` rebuilds the run's batches from (floats round-trip
        # through JSON exactly). A group logged by a recovery has no rewards.
        offset = self._f.tell()
        self._f.write(json.dumps({
            "group": name, "consumed_version": version, **extra,
            "trajectories": [{"uid": tr.uid, "prompt_ids": list(tr.prompt_ids),
                              "segments": [[s.version, len(s.token_ids)] for s in tr.segments],
                              "token_ids": [list(s.token_ids) for s in tr.segments],
                              "logprobs": [list(s.logprobs) for s in tr.segments],
                              "finish_reason": tr.finish_reason,
                              # Multi-turn: which segments were fed (tool results, mask 0).
                              **({"fed": [s.fed for s in tr.segments]}
                                 if any(getattr(s, "fed", False) for s in tr.segments) else {}),
                              **({"tool_calls": tr.tool_calls, "tool_ok": tr.tool_ok}
                                 if getattr(tr, "tool_calls", 0) else {}),
                              **({"reward": tr.reward} if hasattr(tr, "reward") else {})}
                             for tr in trajectories]}) + "\n")
        self.logged[name] = offset

    def close(self) -> None:
        self._f.close()


_GROUP = re.compile(rb'\{"group": ("(?:[^"\\]|\\.)*")')


def _logged_groups(path: Path):
    """(group, byte offset) of each line of trajectories.jsonl, reading only the name
    each line starts with (a long run's file is large; its tokens are not needed)."""
    if not path.exists():
        return
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            m = _GROUP.match(line)
            name = json.loads(m.group(1)) if m else json.loads(line)["group"]
            yield name, offset
            offset += len(line)


def recover(rp: Replayed, state: ScheduleState, *, eta: int, table: TrajectoryTable,
            pool: PartialResponsePool, journal: Journal, consumed: ConsumedLog, task: TaskIO,
            book: Book, reward_group: Callable[[int], None], writer, log=print) -> ScheduleState:
    """Rebuilds what a previous controller of this run left (journal + pool): the
    prompt cursor, consumption the trainer applied unseen (logged now, with a metrics
    record per such step), and every outstanding group with its streamed tokens. A
    group with tokens keeps its staleness reservation at V = its oldest token's version
    (finished groups are rewarded again and wait to be trained); one whose tokens are
    now too old for the bound (V + η below the trainer's version) restarts from its
    prompt, and the discarded tokens are counted. Returns the schedule's new state."""
    if not rp.groups:
        return state
    counts = book.counts
    task.prompts.skip(rp.prompts_taken)   # the stream is deterministic: skip what was taken
    members = {g.problem["uid"]: g.uids for g in rp.groups}
    cut = consumed.reconcile(rp.consumed)
    if cut:
        log(f"trajectories.jsonl: cut off {cut} group(s) logged by a step the restored "
            "trainer does not hold (they train again)")
    for version, names in rp.unlogged:
        for name in names:
            if name in consumed.logged:   # logged before the previous controller stopped
                continue
            consumed.log(name, version, [pool.get(u) for u in members[name] if u in pool],
                         recovered=True)
        journal.write("trained", version=version)
        writer.write("train", version + 1, {"recovered_from_journal": 1.0,
                                            "consumed_groups": len(names)})
    for g in rp.groups:   # consumed or dropped: nothing of them stays in the pool
        if g.problem["uid"] in rp.consumed | rp.dropped:
            for uid in g.uids:
                if uid in pool:
                    pool.drop(uid)
    admissions, finished = [], []
    for g in rp.outstanding():
        problem = Problem(**g.problem)
        rec = table.add_group(problem, tuple(task.encode(problem.prompt)), list(g.target_lens))
        items = [pool.get(u) if u in pool else None for u in g.uids]
        # Sampled tokens' versions (a multi-turn episode's fed tool results have none).
        versions = [s.version for it in items if it for s in it.segments
                    if s.token_ids and not s.fed]
        if not versions:
            for it in filter(None, items):   # nothing streamed: start the group afresh
                pool.drop(it.uid)
            continue
        v_group = min(versions)
        if v_group + eta < book.trainer_version:
            gone = list(filter(None, items))
            journal.write("discard", uids=[it.uid for it in gone])
            for it in gone:
                counts["recovery_discarded_tokens"] += it.num_tokens
                pool.drop(it.uid)
            continue
        for it, tid in zip(items, rec.tids):
            if it is not None:
                t = table.trajs[tid]
                t.tokens = sum(len(s.token_ids) for s in it.segments if not s.fed)
                t.finished = it.finish_reason is not None
        admissions.append((rec.gid, v_group))
        if all(it is not None and it.finish_reason is not None for it in items):
            finished.append(rec.gid)
    cycle = state.cycle
    state = dataclasses.replace(state, cycle=dataclasses.replace(
        cycle, staleness=st.reserve_many(cycle.staleness, admissions)))
    for gid in finished:
        reward_group(gid)
    counts["recovered_groups"] += len(admissions)
    counts["recovered_trajectories"] += sum(1 for gid, _ in admissions
                                            for t in table.members(gid) if t.tokens)
    log(f"recovered from the journal: {rp.prompts_taken} prompts taken, "
        f"{len(rp.consumed)} groups consumed, {len(admissions)} in flight "
        f"({len(finished)} finished), {counts['recovery_discarded_tokens']} stale tokens discarded")
    return state


def count_pool_recovery(pool: PartialResponsePool, counts, log: Callable[[str], None]) -> None:
    """What opening the partial response pool dropped, counted and said: a torn tail,
    and damage in the middle with the trajectories it broke (regenerated)."""
    r = pool.recovery
    counts["recovery_pool_torn_bytes"] += r.torn_bytes
    counts["recovery_pool_damaged_bytes"] += r.damaged_bytes
    counts["recovery_pool_discarded_trajectories"] += len(r.discarded_uids)
    counts["recovery_pool_discarded_tokens"] += r.discarded_tokens
    if r.damaged_bytes:
        log(f"partial response pool: {r.describe(pool.path)}")
