"""A small fake rollout service that executes cycle commands, for property tests.

It plays the real cluster's part: rollouts decode tokens on the version they serve,
preempt under KV pressure, finish trajectories; the trainer consumes and publishes.
Commands to rollouts can be held back (`lag`) so snapshots go stale, as they do when
commands take time to land. Every check a property test needs lives in `check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fnrl.policy import staleness as st
from fnrl.policy.cycle import CycleConfig, decide_cycle, init_cycle_state
from fnrl.policy.schedule import ScheduleState, reconcile
from fnrl.types import (Abort, ClusterSnapshot, Consume, DropGroups, FillPrompts, Interrupt, Migrate, Pull,
                        Route)


@dataclass
class Traj:
    tid: int
    gid: int
    prompt_len: int
    target_len: int            # response tokens it will have when it finishes
    where: object = "ts"       # "ts" | ("run", r) | ("wait", r) | "done" | "aborted"
    tokens: list = field(default_factory=list)   # version of each response token

    @property
    def length(self) -> int:
        return self.prompt_len + len(self.tokens)


class FakeCluster:
    def __init__(self, cfg: CycleConfig, *, num_rollouts: int, group_size: int,
                 kv_capacity: float = 64.0, seed: int = 0):
        self.cfg, self.G = cfg, group_size
        self.eta = cfg.staleness.eta
        self.rng = np.random.default_rng(seed)
        self.R = num_rollouts
        self.version = [0] * num_rollouts
        self.kv_cap = [kv_capacity] * num_rollouts
        self.kv_prev = [0.0] * num_rollouts
        self.complete = [0] * num_rollouts
        self.trajs: dict[int, Traj] = {}
        self.groups: dict[int, list[int]] = {}
        self.ps_version = 0
        self.trainer_busy = False
        self.training: int | None = None
        self.now = 0.0
        self.rewarded: list[int] = []
        self.dropped: list[int] = []
        self.dropped_all: set[int] = set()
        self.consumed: dict[int, int] = {}          # gid -> buffer version it trained
        self.held: list = []                         # rollout commands not landed yet
        self.state = init_cycle_state(cfg, self.version)
        self.admitted: set[int] = set()              # groups with a routed member

    # --- observation ---------------------------------------------------------------

    def kv_used(self, r: int) -> float:
        return float(sum(t.length for t in self.trajs.values() if t.where == ("run", r)))

    def snapshot(self) -> ClusterSnapshot:
        live = [t for t in self.trajs.values() if t.where not in ("done", "aborted")]
        inst = [t.where[1] if isinstance(t.where, tuple) else -1 for t in live]
        snap = ClusterSnapshot(
            now_s=self.now, ps_version=self.ps_version, trainer_idle=not self.trainer_busy,
            inst_version_R=np.array(self.version, np.int64),
            inst_kv_used_R=np.array([self.kv_used(r) for r in range(self.R)]),
            inst_kv_prev_R=np.array(self.kv_prev), inst_kv_capacity_R=np.array(self.kv_cap),
            inst_num_complete_R=np.array(self.complete, np.int64),
            traj_id_N=np.array([t.tid for t in live], np.int64),
            traj_gid_N=np.array([t.gid for t in live], np.int64),
            traj_inst_N=np.array(inst, np.int64).reshape(-1),
            traj_waiting_N=np.array([isinstance(t.where, tuple) and t.where[0] == "wait"
                                     for t in live], bool).reshape(-1),
            traj_len_N=np.array([t.length for t in live], np.int64),
            rewarded_gids=tuple(self.rewarded), dropped_gids=tuple(self.dropped))
        self.rewarded, self.dropped = [], []
        self.kv_prev = [self.kv_used(r) for r in range(self.R)]
        return snap

    # --- the loop --------------------------------------------------------------------

    def cycle(self, *, lag: bool = False) -> tuple:
        snap = self.snapshot()
        if not self.held:
            # As the loop does (fnrl.control.loop, fnrl.sim.cluster): once every command
            # has landed, a speculative state that disagrees with what is observed is
            # reset to it (an abort that lands after its trajectory finished leaves one).
            # While commands are held, the disagreement is theirs: the cycle waits.
            self.state = reconcile(ScheduleState(cycle=self.state, consumed=0,
                                                 next_eval_version=0),
                                   snap, pulls_in_flight=False)[0].cycle
        self.state, cmds = decide_cycle(snap, self.state, self.cfg)
        for c in cmds:
            # Controller-local commands act at once; rollout commands may lag.
            local = isinstance(c, (Consume, FillPrompts, DropGroups)) or (isinstance(c, Abort)
                                                              and c.rid is None)
            if local or not lag:
                self.apply(c)
            else:
                self.held.append(c)
        return cmds

    def land(self) -> None:
        held, self.held = self.held, []
        for c in held:
            self.apply(c)

    def apply(self, c) -> None:
        if isinstance(c, FillPrompts):
            for _ in range(c.num_groups):
                gid = len(self.groups)
                prompt_len = int(self.rng.integers(1, 5))
                tids = []
                for _ in range(self.G):
                    tid = len(self.trajs)
                    self.trajs[tid] = Traj(tid, gid, prompt_len, int(self.rng.integers(1, 12)))
                    tids.append(tid)
                self.groups[gid] = tids
        elif isinstance(c, DropGroups):
            self.dropped_all.update(c.gids)
        elif isinstance(c, Route):
            for tid in c.tids:
                t = self.trajs[tid]
                assert t.where == "ts", (c, t.where)
                self.admitted.add(t.gid)
                self._admit(t, c.rid)
        elif isinstance(c, Interrupt):
            for tid in c.tids:
                t = self.trajs[tid]
                assert isinstance(t.where, tuple) and t.where[1] == c.rid, (c, t.where)
                t.where = "ts"
        elif isinstance(c, Migrate):
            for tid in c.tids:
                t = self.trajs[tid]
                assert isinstance(t.where, tuple) and t.where[1] == c.src, (c, t.where)
                assert self.version[c.dst] >= 0
                self._admit(t, c.dst)
        elif isinstance(c, Abort):
            for tid in c.tids:
                t = self.trajs[tid]
                if t.where == "done" and t.gid in self.dropped_all:
                    # It finished while the abort was on its way: its group is dropped,
                    # so the data path discards it (an abort that lands late is harmless).
                    t.where = "aborted"
                    continue
                want = "ts" if c.rid is None else c.rid
                got = t.where if t.where == "ts" else t.where[1]
                assert got == want, (c, t.where)
                t.where = "aborted"
        elif isinstance(c, Pull):
            assert not any(isinstance(t.where, tuple) and t.where[1] == c.rid
                           for t in self.trajs.values()), f"pull on busy rollout {c.rid}"
            self.version[c.rid] = self.ps_version
            self.complete[c.rid] = 0
        elif isinstance(c, Consume):
            assert not self.trainer_busy
            assert c.version == self.ps_version, (c.version, self.ps_version)
            for gid in c.gids:
                assert gid not in self.consumed, f"group {gid} consumed twice"
                assert gid not in self.dropped_all
                for tid in self.groups[gid]:
                    t = self.trajs[tid]
                    assert t.where == "done"
                    # The bound, on every token: V_traj + η ≥ V_buf.
                    assert min(t.tokens) + self.eta >= c.version, (t.tokens, c.version)
                    if self.eta == 0:
                        assert set(t.tokens) == {c.version}
                self.consumed[gid] = c.version
            self.trainer_busy, self.training = True, c.version
        else:
            raise AssertionError(f"unknown command {c}")

    def _admit(self, t: Traj, r: int) -> None:
        fits = self.kv_used(r) + t.length <= self.kv_cap[r] and not any(
            u.where == ("wait", r) for u in self.trajs.values())
        t.where = ("run", r) if fits else ("wait", r)

    # --- events ----------------------------------------------------------------------

    def decode(self, r: int) -> None:
        """One decode step on rollout r; finished trajectories leave; waiting ones resume."""
        for t in [t for t in self.trajs.values() if t.where == ("run", r)]:
            t.tokens.append(self.version[r])
            if len(t.tokens) >= t.target_len:
                t.where = "done"
                self.complete[r] += 1
                members = [self.trajs[i] for i in self.groups[t.gid]]
                if all(m.where == "done" for m in members) and t.gid not in self.dropped_all:
                    self.rewarded.append(t.gid)
        for t in [t for t in self.trajs.values() if t.where == ("wait", r)]:
            if self.kv_used(r) + t.length <= self.kv_cap[r]:
                t.where = ("run", r)
        # KV pressure: the engine preempts its newest running trajectory.
        while self.kv_used(r) > self.kv_cap[r]:
            run = [t for t in self.trajs.values() if t.where == ("run", r)]
            run[-1].where = ("wait", r)
        self.now += 0.1

    def finish_training(self) -> None:
        if self.trainer_busy:
            self.trainer_busy = False
            self.ps_version = self.training + 1

    def drop(self, gid: int) -> None:
        """The data path discards a group (e.g. no learning signal)."""
        if gid in self.groups and gid not in self.consumed and gid not in self.dropped_all:
            self.dropped.append(gid)
            self.dropped_all.add(gid)

    # --- invariants ------------------------------------------------------------------

    def check(self) -> None:
        s = self.state.staleness
        seen = set()
        for k, buf in enumerate(s.buffers):
            assert len(buf) <= s.capacity
            for e in buf:
                assert e.version + s.eta >= s.v_train + k, (e, s.v_train + k)
                assert e.gid not in seen
                seen.add(e.gid)
                assert e.gid not in self.consumed
        for gid in self.admitted:
            # Nothing is lost: an admitted group is tracked, consumed or dropped.
            assert gid in seen or gid in self.consumed or gid in self.dropped_all \
                or gid in self.state.doomed_gids, gid
        for t in self.trajs.values():
            if isinstance(t.where, tuple):
                # Served only by versions ≥ its group's V (partial rollouts included).
                v = st.group_versions(s).get(t.gid)
                assert v is None or self.version[t.where[1]] >= v or self.held
