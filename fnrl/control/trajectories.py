"""The controller's trajectory server: the one store of record of every trajectory and
group in flight.

A group enters with its prompt (its members in the TS, no tokens), each member is
routed to a rollout, streams tokens into the partial response pool (the durable log of
what was sampled), and either finishes there or is interrupted back to the TS with its
tokens kept, to be routed again (re-prefill). A group whose members all finished is
rewarded (`GroupRecord.group`) and waits until a Consume trains it or a drop discards it.

Identity: `tid` and `gid` are dense ints in arrival order (the rows of the snapshot's
columns); the durable names derive from the problem: the group is `problem.uid` (the
journal's key) and member k is `f"{problem.uid}/{k}"` (the pool's key). Nothing else
holds a copy: the staleness state holds gids only, the pool holds tokens by uid.
The table only records; the loop moves things (one thread, no locks).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from fnrl.types import ClusterSnapshot, Group, Problem

IN_TS = -1


@dataclass
class Tracked:
    tid: int
    gid: int
    uid: str
    prompt_ids: tuple[int, ...]
    target_len: int | None        # forced response length (long-tail workload), or None
    inst: int = IN_TS             # rollout it is placed on, or IN_TS
    tokens: int = 0               # response tokens streamed so far (all placements)
    started: bool = False         # the current placement has produced a token
    finished: bool = False
    aborted: bool = False
    task: asyncio.Task | None = None   # the stream of its current (or last) placement
    placements: int = 0

    @property
    def live(self) -> bool:
        return not (self.finished or self.aborted)

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + self.tokens


@dataclass
class GroupRecord:
    gid: int
    problem: Problem
    tids: tuple[int, ...]
    group: Group | None = None    # rewarded: the members' tokens, log-probs and rewards
    dropped: bool = False
    consumed: bool = False

    @property
    def name(self) -> str:
        return self.problem.uid


@dataclass
class TrajectoryTable:
    trajs: dict[int, Tracked] = field(default_factory=dict)
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    rewarded: list[int] = field(default_factory=list)    # events the next cycle reads
    dropped: list[int] = field(default_factory=list)

    def add_group(self, problem: Problem, prompt_ids: tuple[int, ...],
                  target_lens: list[int | None]) -> GroupRecord:
        gid = len(self.groups)
        tids = []
        for k, target in enumerate(target_lens):
            tid = len(self.trajs)
            self.trajs[tid] = Tracked(tid, gid, f"{problem.uid}/{k}", prompt_ids, target)
            tids.append(tid)
        self.groups[gid] = GroupRecord(gid, problem, tuple(tids))
        return self.groups[gid]

    def members(self, gid: int) -> list[Tracked]:
        return [self.trajs[t] for t in self.groups[gid].tids]

    def on(self, rid: int) -> list[Tracked]:
        return [t for t in self.trajs.values() if t.live and t.inst == rid]

    def reward(self, gid: int, group: Group, *, keep: bool) -> None:
        """The group's members all finished and were rewarded: it waits to be trained
        (keep) or is discarded now (a data-path filter decided so)."""
        rec = self.groups[gid]
        if keep:
            rec.group = group
            self.rewarded.append(gid)
        else:
            self.drop([gid])

    def drop(self, gids, *, event: bool = True) -> None:
        """Discards groups for good; `event`: the next snapshot tells the cycle (a drop
        the cycle itself decided needs no telling)."""
        for gid in gids:
            rec = self.groups[gid]
            rec.dropped, rec.group = True, None
            if event:
                self.dropped.append(gid)

    def consume(self, gids) -> tuple[Group, ...]:
        """The rewarded groups a Consume trains, in its order; they leave the table."""
        out = []
        for gid in gids:
            rec = self.groups[gid]
            if rec.group is None:
                raise KeyError(f"group {rec.name} (gid {gid}) is not rewarded")
            out.append(rec.group)
            rec.group, rec.consumed = None, True
        return tuple(out)

    def take_events(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(rewarded, dropped) gids since the last call: each event is read once."""
        events = tuple(self.rewarded), tuple(self.dropped)
        self.rewarded, self.dropped = [], []
        return events

    def snapshot(self, *, now_s: float, ps_version: int, trainer_idle: bool,
                 inst_version_R, inst_kv_prev_R, inst_kv_capacity_R, inst_num_complete_R,
                 waiting_counts: list[int], rewarded_gids: tuple[int, ...] = (),
                 dropped_gids: tuple[int, ...] = (), inst_max_seqs_R=None) -> ClusterSnapshot:
        """The columnar view the coordinator reads. Changes nothing.

        KV in use is the context of every placed trajectory that is not waiting:
        exactly what the engine holds for them (prompt + streamed tokens). Which
        trajectories wait is not exposed by vLLM; it reports how many, and the newest
        placements without a token yet are the ones it has not scheduled.
        """
        live = [t for t in self.trajs.values() if t.live]
        n = len(live)
        inst = np.fromiter((t.inst for t in live), np.int64, n)
        length = np.fromiter((t.context_len for t in live), np.int64, n)
        waiting = np.zeros(n, bool)
        for r, w in enumerate(waiting_counts):
            if w > 0:
                cand = [i for i, t in enumerate(live) if t.inst == r and not t.started]
                waiting[cand[-w:]] = True
        R = len(inst_version_R)
        running = (inst >= 0) & ~waiting
        kv_used = np.bincount(inst[running], weights=length[running], minlength=R)[:R]
        return ClusterSnapshot(
            now_s=now_s, ps_version=ps_version, trainer_idle=trainer_idle,
            inst_version_R=np.asarray(inst_version_R, np.int64),
            inst_kv_used_R=kv_used.astype(np.float64),
            inst_kv_prev_R=np.asarray(inst_kv_prev_R, np.float64),
            inst_kv_capacity_R=np.asarray(inst_kv_capacity_R, np.float64),
            inst_num_complete_R=np.asarray(inst_num_complete_R, np.int64),
            traj_id_N=np.fromiter((t.tid for t in live), np.int64, n),
            traj_gid_N=np.fromiter((t.gid for t in live), np.int64, n),
            traj_inst_N=inst, traj_waiting_N=waiting, traj_len_N=length,
            rewarded_gids=tuple(rewarded_gids), dropped_gids=tuple(dropped_gids),
            inst_max_seqs_R=None if inst_max_seqs_R is None
            else np.asarray(inst_max_seqs_R, np.int64))
