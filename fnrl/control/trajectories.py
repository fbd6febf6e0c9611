"""The controller's trajectory server: every trajectory's place in its lifecycle.

A trajectory is created with its group when prompts are filled (in the TS, no tokens),
routed to a rollout, streams tokens into the partial response pool, and either
finishes there or is interrupted back to the TS with its tokens kept, to be routed
again (re-prefill) on the same or another rollout. Ids are ints in arrival order,
group members together; `uid` strings name them in the pool and in the run's logs.
The table only records where things are; the loop moves them (one thread, no locks).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from fnrl.data.arith import Problem
from fnrl.types import ClusterSnapshot

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
    dropped: bool = False


@dataclass
class TrajectoryTable:
    trajs: dict[int, Tracked] = field(default_factory=dict)
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    rewarded: list[int] = field(default_factory=list)    # events since the last observe
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

    def on(self, rid: int) -> list[Tracked]:
        return [t for t in self.trajs.values() if t.live and t.inst == rid]

    def snapshot(self, *, now_s: float, ps_version: int, trainer_idle: bool,
                 inst_version_R, inst_kv_prev_R, inst_kv_capacity_R, inst_num_complete_R,
                 waiting_counts: list[int]) -> ClusterSnapshot:
        """The columnar view the coordinator reads; drains the reward and drop events.

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
        snap = ClusterSnapshot(
            now_s=now_s, ps_version=ps_version, trainer_idle=trainer_idle,
            inst_version_R=np.asarray(inst_version_R, np.int64),
            inst_kv_used_R=kv_used.astype(np.float64),
            inst_kv_prev_R=np.asarray(inst_kv_prev_R, np.float64),
            inst_kv_capacity_R=np.asarray(inst_kv_capacity_R, np.float64),
            inst_num_complete_R=np.asarray(inst_num_complete_R, np.int64),
            traj_id_N=np.fromiter((t.tid for t in live), np.int64, n),
            traj_gid_N=np.fromiter((t.gid for t in live), np.int64, n),
            traj_inst_N=inst, traj_waiting_N=waiting, traj_len_N=length,
            rewarded_gids=tuple(self.rewarded), dropped_gids=tuple(self.dropped))
        self.rewarded, self.dropped = [], []
        return snap
