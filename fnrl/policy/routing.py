"""StaleFlow's rollout coordination (seed 001 §5): validation, routing, sync, migration.

- The decode cost model (`fnrl.config.CostModel`, evaluated by fnrl.policy.cost_model):
  throughput T_i(S) (§5.3 Eq. 2, App. B Eq. 11) and the marginal and ideal gains of
  routing one trajectory (Eqs. 3, 4).
- `SpeculativeState` and `snapshot_is_valid`: a snapshot is used only once it reflects
  every command already issued (§5.2, Eq. 1, Table 1).
- `route`: the multi-level queue and waterfall selection with threshold μ (Alg. 3),
  admitting initial trajectories through the staleness discriminator (Alg. 2).
- `plan_sync`: lazy per-instance synchronization (Alg. 4).
- `plan_migration`: wait-queue overflow (φ_wait) and throughput gap (φ_throughput) (Alg. 5);
  Case 2 moves only what routing would place on another rollout.

All of it works on a `WorkingView`: a mutable numpy copy of one snapshot that lives for
one decision cycle and is updated by each strategy in turn, as Alg. 1 updates its local
copy of S. Nothing here reads a clock, a file or a socket.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fnrl.config import CostModel, RoutingConfig
from fnrl.policy import cost_model
from fnrl.policy.staleness import StalenessState, reserve_slot
from fnrl.types import Abort, ClusterSnapshot, Interrupt, Migrate, Pull, Route

# --- snapshot validation (§5.2) ---------------------------------------------------------


GONE = -2  # traj_inst value for a trajectory aborted within this cycle


def _none() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass(frozen=True, eq=False)
class SpeculativeState:
    """P: per rollout, the version and trajectory count every issued command implies;
    and where each trajectory the last valid cycle moved must be seen (`expect_tid_M`
    at `expect_at_M`: a rollout, -1 for the trajectory server, GONE when aborted).

    Gap (ours): Eq. 1 compares counts only, and commands of one cycle can cancel in a
    count: an Abort (or Interrupt) and a Route on the same rollout leave it unchanged,
    so a snapshot taken before either lands passes Eq. 1 and the next cycle routes the
    same trajectory again (a double Route, found by tests/policy/test_cycle.py's random
    schedules). The expected placements close that: a snapshot is valid only once every
    moved trajectory is where its last command put it, or has finished."""

    version_R: np.ndarray
    accum_R: np.ndarray
    expect_tid_M: np.ndarray = field(default_factory=_none)
    expect_at_M: np.ndarray = field(default_factory=_none)

    @staticmethod
    def initial(inst_version_R: Sequence[int]) -> "SpeculativeState":
        v = np.asarray(inst_version_R, dtype=np.int64)
        return SpeculativeState(v.copy(), np.zeros_like(v))

    @staticmethod
    def from_snapshot(snap: ClusterSnapshot) -> "SpeculativeState":
        """Re-anchor P on what is observed (after a command failed and P can never match)."""
        return SpeculativeState(np.asarray(snap.inst_version_R, np.int64).copy(),
                                observed_counts(snap))


def observed_counts(snap: ClusterSnapshot) -> np.ndarray:
    """|run ∪ wait ∪ complete| per rollout, the right side of Eq. 1."""
    placed = snap.traj_inst_N[snap.traj_inst_N >= 0]
    return (np.bincount(placed, minlength=snap.num_rollouts).astype(np.int64)
            + np.asarray(snap.inst_num_complete_R, np.int64))


def snapshot_is_valid(p: SpeculativeState, snap: ClusterSnapshot) -> bool:
    """Eq. 1: every rollout's version and trajectory count match P; and every trajectory
    P expects somewhere is there, or no longer tracked (finished or aborted)."""
    if not (len(p.version_R) == snap.num_rollouts
            and np.array_equal(p.version_R, snap.inst_version_R)
            and np.array_equal(p.accum_R, observed_counts(snap))):
        return False
    ids = np.asarray(snap.traj_id_N, np.int64)
    if p.expect_tid_M.size == 0 or ids.size == 0:
        return True
    order = np.argsort(ids, kind="stable")
    pos = order[np.minimum(np.searchsorted(ids[order], p.expect_tid_M), ids.size - 1)]
    tracked = ids[pos] == p.expect_tid_M
    seen_at = np.asarray(snap.traj_inst_N, np.int64)[pos]
    return bool(np.all(~tracked | (seen_at == p.expect_at_M)))


def apply_commands(p: SpeculativeState, commands: Sequence, ps_version: int) -> SpeculativeState:
    """Table 1: the effect of issued commands on P, and where each trajectory they move
    must be seen (the last command naming it wins). Called on a valid snapshot, whose
    earlier expectations are therefore met: only these commands' are kept."""
    version, accum = p.version_R.copy(), p.accum_R.copy()
    expect: dict[int, int] = {}
    for c in commands:
        if isinstance(c, Pull):
            version[c.rid], accum[c.rid] = ps_version, 0
        elif isinstance(c, Route):
            accum[c.rid] += len(c.tids)
            expect.update(dict.fromkeys(c.tids, c.rid))
        elif isinstance(c, Interrupt):
            accum[c.rid] -= len(c.tids)
            expect.update(dict.fromkeys(c.tids, -1))
        elif isinstance(c, Abort):
            if c.rid is not None:
                accum[c.rid] -= len(c.tids)
            expect.update(dict.fromkeys(c.tids, GONE))
        elif isinstance(c, Migrate):
            accum[c.src] -= len(c.tids)
            accum[c.dst] += len(c.tids)
            expect.update(dict.fromkeys(c.tids, c.dst))
    return SpeculativeState(version, accum, np.fromiter(expect.keys(), np.int64, len(expect)),
                            np.fromiter(expect.values(), np.int64, len(expect)))


# --- the working view ---------------------------------------------------------------------


class WorkingView:
    """A mutable copy of a snapshot for one cycle (Alg. 1's local S)."""

    def __init__(self, snap: ClusterSnapshot, group_version: dict[int, int], cost: CostModel):
        self.cost = cost
        self.R = snap.num_rollouts
        self.version = np.asarray(snap.inst_version_R, np.int64).copy()
        self.kv = np.asarray(snap.inst_kv_used_R, np.float64).copy()
        self.kv_prev = np.asarray(snap.inst_kv_prev_R, np.float64)
        self.cap = np.asarray(snap.inst_kv_capacity_R, np.float64)
        # The engine's sequence cap: a trajectory placed on a full batch waits, as one
        # whose KV does not fit does (inf: no cap).
        self.max_seqs = (np.full(self.R, np.inf) if snap.inst_max_seqs_R is None
                         else np.asarray(snap.inst_max_seqs_R, np.float64))
        self.tid = np.asarray(snap.traj_id_N, np.int64)
        self.gid = np.asarray(snap.traj_gid_N, np.int64)
        self.length = np.asarray(snap.traj_len_N, np.int64)
        self.inst = np.asarray(snap.traj_inst_N, np.int64).copy()
        self.waiting = np.asarray(snap.traj_waiting_N, bool).copy()
        self.vtraj = _lookup(group_version, self.gid)  # -1: initial (group not admitted)
        on = self.inst >= 0
        self.n_run = np.bincount(self.inst[on & ~self.waiting], minlength=self.R).astype(float)
        self.n_wait = np.bincount(self.inst[on & self.waiting], minlength=self.R).astype(float)
        # Members of each rollout as placed in the snapshot (CSR), plus later arrivals.
        key = np.where(on, self.inst, self.R)
        # numpy's stable sort is a radix sort for 16-bit keys: O(N) for R < 32767.
        small = key.astype(np.int16) if self.R < np.iinfo(np.int16).max else key
        self._order = np.argsort(small, kind="stable")
        self._starts = np.searchsorted(key[self._order], np.arange(self.R + 1))
        self._arrived: dict[int, list[int]] = {}
        self.touched = np.zeros(self.R, bool)  # interrupted or pulled in this cycle
        # Moved as often as a step allows (RoutingConfig.moves_per_step): no rule that
        # moves work takes these (set by the cycle).
        self.pinned = np.zeros(self.tid.shape, bool)

    def members(self, r: int) -> np.ndarray:
        """Indices of the trajectories on rollout r now."""
        idx = self._order[self._starts[r]:self._starts[r + 1]]
        if r in self._arrived:
            idx = np.concatenate([idx, np.asarray(self._arrived[r], np.int64)])
        return idx[self.inst[idx] == r]

    def _leave(self, idx: np.ndarray) -> None:
        src = self.inst[idx]
        run = ~self.waiting[idx]
        np.subtract.at(self.kv, src[run], self.cost.k5 * self.length[idx[run]])
        np.maximum(self.kv, 0.0, out=self.kv)
        np.subtract.at(self.n_run, src[run], 1)
        np.subtract.at(self.n_wait, src[~run], 1)

    def to_ts(self, idx: np.ndarray) -> None:
        """Interrupt: back to the trajectory server."""
        if idx.size:
            self._leave(idx)
            self.inst[idx] = -1
            self.waiting[idx] = False

    def drop(self, idx: np.ndarray) -> None:
        on = idx[self.inst[idx] >= 0]
        if on.size:
            self._leave(on)
        self.inst[idx] = GONE

    def place(self, idx: Sequence[int], dst: int) -> None:
        """Route or migrate onto dst; each one runs if its KV fits, the batch is under
        the engine's sequence cap and none waits (Eq. 3)."""
        idx = np.asarray(idx, np.int64)
        moving = idx[self.inst[idx] >= 0]
        if moving.size:
            self._leave(moving)
        kv, cap, k5 = float(self.kv[dst]), float(self.cap[dst]), self.cost.k5
        n_run, n_wait = float(self.n_run[dst]), float(self.n_wait[dst])
        max_seqs = float(self.max_seqs[dst])
        waits = []
        for length in self.length[idx].tolist():
            if n_wait == 0 and n_run < max_seqs and kv + k5 * length <= cap:
                kv, n_run = kv + k5 * length, n_run + 1
                waits.append(False)
            else:
                n_wait += 1
                waits.append(True)
        self.kv[dst], self.n_run[dst], self.n_wait[dst] = kv, n_run, n_wait
        self.waiting[idx] = waits
        self.inst[idx] = dst
        self._arrived.setdefault(dst, []).extend(idx.tolist())

    def pull(self, r: int, version: int) -> None:
        self.version[r] = version
        self.touched[r] = True

    def fork(self) -> "WorkingView":
        """An independent copy, for a tentative plan that must not touch this cycle's view."""
        other = copy.copy(self)
        for name in ("version", "kv", "inst", "waiting", "n_run", "n_wait", "touched"):
            setattr(other, name, getattr(self, name).copy())
        other._arrived = {r: list(v) for r, v in self._arrived.items()}
        return other


def _lookup(table: dict[int, int], keys: np.ndarray) -> np.ndarray:
    if not table:
        return np.full(keys.shape, -1, np.int64)
    k = np.fromiter(table.keys(), np.int64, len(table))
    v = np.fromiter(table.values(), np.int64, len(table))
    order = np.argsort(k)
    k, v = k[order], v[order]
    pos = np.minimum(np.searchsorted(k, keys), len(k) - 1)
    return np.where(k[pos] == keys, v[pos], -1)


# --- routing (Alg. 2, 3) -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    routes: dict[int, list[int]]           # rollout -> trajectory indices, in routing order
    admissions: list[tuple[int, int]]      # (gid, V) to Reserve, in order
    waits: dict[int, list[bool]]           # per route: does it land in the waiting queue
    load: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # kv, n_run, n_wait after


def quantize_length(length: int, resolution: int) -> float:
    """Round up to a geometric grid with `resolution` points per doubling (0: exact)."""
    if resolution <= 0 or length <= 1:
        return float(length)
    return 2.0 ** (math.ceil(math.log2(length) * resolution) / resolution)


def route(view: WorkingView, staleness: StalenessState, empties: list[int], mu: float, *,
          version: np.ndarray | None = None, gain_resolution: int = 16,
          max_routes: int | None = None, policy: str = "waterfall") -> RoutingPlan:
    """Alg. 3 over the trajectories in the TS. Reads `view` without changing it;
    `empties` (free entries per buffer) is updated in place as groups are admitted, so a
    probe within one cycle sees earlier admissions (digest note on Alg. 2). `version`
    overrides rollout versions (the tentative sync of Alg. 4).

    Speed: a cycle may route thousands of trajectories over a thousand rollouts, so the
    gains of all rollouts are computed in one numpy pass per trajectory length, the best
    rollout of each version group is cached, and routing one trajectory touches only the
    chosen rollout. Gap (ours, for speed): gains are evaluated at the length rounded up
    to `gain_resolution` points per doubling (6% at 16), so trajectories of similar length
    share that pass; the KV-fit test errs on the safe side, and loads are updated with
    exact lengths. The threshold μ·ΔT_ideal is taken at the same rounded length, so an
    idle rollout scores exactly ΔT_ideal and μ = 1 still admits to idle rollouts.

    A rollout whose batch is at the engine's sequence cap (`view.max_seqs`) scores no
    gain, as one whose KV is full does: Eq. 2's T_i(S) holds for the batch the engine
    runs, and one more trajectory there would wait. Gap (ours): StaleFlow's cost model
    has no such cap; without it routing over-fills instances whose roofline batch
    k2/k3 exceeds max_num_seqs (docs/simulation.md, LlamaRL).

    `policy="fewest"` (§6.5's vanilla routing, `RoutingConfig.policy`) scores a rollout
    by minus its trajectory count instead of its gain, takes the best admissible one over
    every version group, and withholds only when every admissible rollout is down (KV
    capacity 0, as the loop reports a rollout that is down); queue order and the
    protocol's checks are the same.
    """
    fewest = policy == "fewest"
    cost = view.cost
    version = view.version if version is None else version
    ts = np.flatnonzero(view.inst == -1)
    routes: dict[int, list[int]] = {}
    waits: dict[int, list[bool]] = {}
    admissions: list[tuple[int, int]] = []
    if ts.size == 0 or view.R == 0:
        return RoutingPlan(routes, admissions, waits)
    # Multi-level queue: increasing V_traj, initial trajectories last (Alg. 3 line 1).
    # Gap: the paper gives no order within a level; we take the longest context first
    # (longest-processing-time-first for the makespan), then snapshot order (the
    # controller lists trajectories in arrival order, a group's members together), so
    # equal lengths share one gain computation.
    vt = view.vtraj[ts]
    level = np.where(vt >= 0, vt, max(int(vt.max()), 0) + 1)   # initial: after every V
    key = (level - level.min()) * (1 << 32) + ((1 << 31) - 1 - view.length[ts])
    if max_routes is not None and max_routes < ts.size:
        # Only the first max_routes matter: select them in O(N), then sort those.
        top = np.argpartition(key, max_routes - 1)[:max_routes]
        ts, key = ts[top], key[top]
    ts = ts[np.argsort(key, kind="stable")]
    # Rollouts sorted by version: the waterfall's groups R_{i,j}, lowest version first.
    inst_order = np.argsort(version, kind="stable")
    ver_s = version[inst_order]
    starts = np.flatnonzero(np.r_[True, ver_s[1:] != ver_s[:-1]])
    bounds = list(zip(starts.tolist(), np.r_[starts[1:], len(ver_s)].tolist()))
    group_v = ver_s[starts].tolist()
    group_of = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ver_s)])).tolist()
    kv, n = view.kv[inst_order].copy(), view.n_run[inst_order].copy()
    n_wait, cap = view.n_wait[inst_order].copy(), view.cap[inst_order]
    max_seqs = view.max_seqs[inst_order]
    t0 = cost_model.throughput(cost, kv, n)
    k1, k2, k3, k4, k5 = cost.k1, cost.k2, cost.k3, cost.k4, cost.k5
    # Eq. 3 split into the parts that do not depend on the length, so a gain pass is five
    # numpy operations: ΔT = (n+1) / (base + k1·k5·l) − T0 where the KV still has room.
    base = k1 * kv + np.maximum(k2, k3 * (n + 1)) + k4
    room = np.where((n_wait == 0) & (n < max_seqs), cap - kv, -np.inf)
    admissible = [reserve_slot(empties, staleness, v) is not None for v in group_v]
    new_v: dict[int, int] = {}
    gain, gain_len = None, None
    best: list[int] = []
    best_val: list[float] = []
    for i, g, length, v_traj in zip(ts.tolist(), view.gid[ts].tolist(),
                                    view.length[ts].tolist(), view.vtraj[ts].tolist()):
        v_traj = v_traj if v_traj >= 0 else new_v.get(g, -1)
        q = quantize_length(length, gain_resolution)
        if fewest and gain is None:
            gain = np.where(cap > 0, -(n + n_wait), -np.inf)   # a down rollout takes none
            best = [a + int(np.argmax(gain[a:b])) for a, b in bounds]
            best_val = [float(gain[j]) for j in best]
        elif not fewest and q != gain_len:
            gain = np.where(k5 * q <= room, (n + 1) / (base + k1 * k5 * q) - t0, 0.0)
            gain_len = q
            best = [a + int(np.argmax(gain[a:b])) for a, b in bounds]
            best_val = [float(gain[j]) for j in best]
            # ΔT_ideal at the rounded length q, summed in the gain pass's order, so an
            # idle rollout's gain equals it bit for bit (at the exact length it would be
            # larger, and μ near 1 would never admit anything). The relative slack
            # absorbs the float residue a drained rollout's KV keeps after subtractions.
            ideal = 1.0 / ((max(k2, k3) + k4) + k1 * k5 * q)
            threshold = mu * ideal * (1.0 - 1e-9)
        chosen = -1
        for gi, gv in enumerate(group_v):
            # check_routable (Alg. 2): partial trajectories (and members of admitted
            # groups) need version ≥ V_traj; initial ones a successful simulated Reserve.
            if (gv < v_traj) if v_traj >= 0 else not admissible[gi]:
                continue
            if fewest:
                if best_val[gi] > -np.inf and (chosen < 0 or best_val[gi] > gain[chosen]):
                    chosen = best[gi]
            elif best_val[gi] >= threshold and best_val[gi] > 0:
                chosen = best[gi]
                break
        if chosen < 0:
            break  # withheld: stop routing this cycle (Alg. 3, strict head-of-line)
        if v_traj < 0:
            gv = int(ver_s[chosen])
            k = reserve_slot(empties, staleness, gv)
            empties[k] -= 1
            new_v[g] = gv
            admissions.append((g, gv))
            if empties[k] == 0:
                admissible = [reserve_slot(empties, staleness, v) is not None for v in group_v]
        r = int(inst_order[chosen])
        routes.setdefault(r, []).append(i)
        # update_snapshot (Eq. 3) on the chosen rollout only, in plain floats.
        c_kv, c_n, c_w = float(kv[chosen]), float(n[chosen]), float(n_wait[chosen])
        runs = c_w == 0 and c_n < max_seqs[chosen] and c_kv + k5 * length <= cap[chosen]
        waits.setdefault(r, []).append(not runs)
        if runs:
            c_kv, c_n = c_kv + k5 * length, c_n + 1
            kv[chosen], n[chosen] = c_kv, c_n
        else:
            c_w += 1
            n_wait[chosen] = c_w
        c_t0 = c_n / (k1 * c_kv + max(k2, k3 * c_n) + k4)
        t0[chosen] = c_t0
        base[chosen] = k1 * c_kv + max(k2, k3 * (c_n + 1)) + k4
        open_ = c_w == 0 and c_n < max_seqs[chosen]
        room[chosen] = cap[chosen] - c_kv if open_ else -np.inf
        kv1 = c_kv + k5 * q
        new_gain = 0.0
        if fewest:
            new_gain = -(c_n + c_w)
        elif kv1 <= cap[chosen] and open_:
            new_gain = (c_n + 1) / (k1 * kv1 + max(k2, k3 * (c_n + 1)) + k4) - c_t0
        gain[chosen] = new_gain
        gi = group_of[chosen]
        if chosen == best[gi] and new_gain < best_val[gi]:
            a, b = bounds[gi]
            best[gi] = a + int(np.argmax(gain[a:b]))
            best_val[gi] = float(gain[best[gi]])
        elif new_gain > best_val[gi]:
            best[gi], best_val[gi] = chosen, new_gain
    back = np.empty_like(inst_order)
    back[inst_order] = np.arange(len(inst_order))
    return RoutingPlan(routes, admissions, waits, (kv[back], n[back], n_wait[back]))


# --- synchronization (Alg. 4) ----------------------------------------------------------------


def plan_sync(view: WorkingView, staleness: StalenessState, empties: Sequence[int],
              cfg: RoutingConfig, ps_version: int) -> list[int]:
    """Rollouts to interrupt and Pull now."""
    behind = view.version < ps_version
    if not behind.any():
        return []
    if cfg.sync == "greedy":
        return np.flatnonzero(behind).tolist()
    idle = view.n_run + view.n_wait == 0
    if cfg.sync == "on_idle":
        return np.flatnonzero(behind & idle).tolist()
    if cfg.sync == "global":
        # One collective for the whole rollout fleet (verl's NCCL broadcast at a global
        # point): nothing moves until every rollout has run dry.
        return np.flatnonzero(behind).tolist() if idle.all() else []
    # Eligible: behind, and no TS trajectory passes check_routable on it (Alg. 4 line 3).
    ts = view.inst == -1
    partial = ts & (view.vtraj >= 0)
    routable = np.zeros(view.R, bool)
    if partial.any():
        routable |= view.version >= view.vtraj[partial].min()
    if (ts & (view.vtraj < 0)).any():
        versions = np.unique(view.version)
        ok = np.array([reserve_slot(list(empties), staleness, int(v)) is not None
                       for v in versions])
        routable |= ok[np.searchsorted(versions, view.version)]
    eligible = behind & ~routable
    if not eligible.any():
        return []
    # Tentative update and routing (Alg. 4 lines 4-7). Gap/deviation: the paper runs one
    # tentative routing per eligible rollout; we run one with all eligible rollouts
    # upgraded together, which costs one routing pass instead of up to R, and syncs only
    # rollouts that would actually receive work now (the lazier choice: a rollout that
    # loses every trajectory to an equally upgraded peer keeps its KV and goes on).
    tentative = np.where(eligible, ps_version, view.version)
    plan = route(view, staleness, list(empties), cfg.mu, version=tentative,
                 gain_resolution=cfg.gain_resolution, max_routes=cfg.max_routes,
                 policy=cfg.policy)
    return sorted(r for r in plan.routes if eligible[r])


def sync_commands(view: WorkingView, rollouts: Sequence[int], ps_version: int) -> list:
    """Alg. 1 lines 3-7: Interrupt all run+wait trajectories, then Pull."""
    cmds = []
    for r in rollouts:
        idx = view.members(r)
        if idx.size:
            cmds.append(Interrupt(r, tuple(view.tid[idx].tolist())))
            view.to_ts(idx)
        cmds.append(Pull(r))
        view.pull(r, ps_version)
    return cmds


# --- migration (Alg. 5) ----------------------------------------------------------------------


def plan_migration(view: WorkingView, cfg: RoutingConfig, staleness: StalenessState,
                   empties: Sequence[int]) -> list:
    """Interrupt commands for wait-queue overflow and the throughput gap; applied to view.
    `staleness` and `empties` are only read: Case 2 routes tentatively on them."""
    cmds = []
    # Case 1: more than φ_wait waiting. Gap (digest gap 7): the paper does not say which
    # waiting trajectories leave; we move the shortest contexts, the cheapest to
    # re-prefill elsewhere (OrchestrRL's short-context-first rule, seed 003 §4.2).
    # Gap (ours, as Case 2's below): Alg. 5 returns them to the TS for re-routing, and
    # under KV pressure routing sends them straight back to the queue they left (with
    # "fewest" routing, every cycle: 650 interrupts per trajectory in 3 steps of a 64-GPU
    # simulation). A waiting trajectory gains only by running elsewhere, so only those
    # that routing, on this snapshot, would start at once on another rollout leave.
    over = view.n_wait > cfg.phi_wait
    if over.any():
        w = np.flatnonzero(view.waiting & (view.inst >= 0) & ~view.pinned)
        w = w[over[view.inst[w]]]
        w = w[np.lexsort((view.tid[w], view.length[w], view.inst[w]))]
        inst_w = view.inst[w]
        first = np.flatnonzero(np.r_[True, inst_w[1:] != inst_w[:-1]])
        rank = np.arange(len(w)) - np.repeat(first, np.diff(np.r_[first, len(w)]))
        out = w[rank < (view.n_wait[inst_w] - cfg.phi_wait)]
        out = _placed_elsewhere(view, out, cfg, staleness, empties, running=True)
        out = out[np.lexsort((view.tid[out], view.length[out], view.inst[out]))]
        inst_out = view.inst[out]
        cut = np.flatnonzero(np.r_[True, inst_out[1:] != inst_out[:-1]])
        for r, part in zip(inst_out[cut].tolist() if out.size else [],
                           np.split(out, cut[1:])):
            cmds.append(Interrupt(r, tuple(view.tid[part].tolist())))
        view.to_ts(out)
        view.touched[inst_out] = True
    # Case 2: T_max / T_min > φ_throughput: redistribute everything on the fastest.
    # Gap (digest gap 6): T_min = 0 (an idle rollout) makes the gap infinite; we take
    # the minimum over busy rollouts, since routing already fills idle ones from the TS
    # at ideal gain, and counting them would redistribute every cycle.
    busy = view.n_run > 0
    if busy.sum() >= 2:
        t = cost_model.throughput(view.cost, view.kv, view.n_run)
        t_busy = np.where(busy, t, np.inf)
        r_max = int(np.argmax(np.where(busy, t, -np.inf)))
        if t[r_max] > cfg.phi_throughput * t_busy.min():
            idx = view.members(r_max)
            idx = _placed_elsewhere(view, idx[~view.pinned[idx]], cfg, staleness, empties)
            if idx.size:
                cmds.append(Interrupt(r_max, tuple(view.tid[idx].tolist())))
                view.to_ts(idx)
                view.touched[r_max] = True
    return cmds


def _placed_elsewhere(view: WorkingView, idx: np.ndarray, cfg: RoutingConfig,
                      staleness: StalenessState, empties: Sequence[int], *,
                      running: bool = False) -> np.ndarray:
    """Which of `idx` a migration moves: those routing would place on a rollout other
    than their own (with `running`, only where they start at once: Case 1).

    Case 2 (the fastest rollout's trajectories `idx`):

    Gap (digest gap 6, and the paper's missing cool-down): Alg. 5 returns all of r's
    trajectories to the TS "for redistribution by the routing strategy". The fastest
    rollout is usually fast because it holds many short contexts, and once emptied it is
    the best place for them again (an idle rollout scores ΔT_ideal), so routing sends
    them straight back: a net-zero move that costs every one a re-admission and, on
    each cycle the gap persists, livelocks them (they are interrupted again before
    producing a token). The gap's remedy is the redistribution, not the interrupt, so we
    keep the paper's trigger and move only what redistribution would actually move: we
    route tentatively with r emptied, as Alg. 4 routes tentatively before a sync, and
    interrupt only r's trajectories that land on another rollout. Ones routed back to r,
    or withheld, stay where they are, decoding. No cool-down is needed: a trajectory
    moves only when routing, on this very snapshot, would place it elsewhere, so a cycle
    repeated on its own result moves nothing back (what a changing cluster could still do
    across cycles is bounded per step by RoutingConfig.moves_per_step)."""
    # Those that stay change the routing of those that leave (loads, ties), so repeat on
    # the smaller set until routing places every one elsewhere: the set only shrinks,
    # and the cycle's own routing, on the same view, then makes the same placements
    # (unless repack or balancing, which run in between, change the view first).
    while idx.size:
        origin = view.inst[idx]
        probe = view.fork()
        probe.to_ts(idx)
        plan = route(probe, staleness, list(empties), cfg.mu,
                     gain_resolution=cfg.gain_resolution, max_routes=cfg.max_routes,
                     policy=cfg.policy)
        dest = np.full(view.tid.shape, -1, np.int64)
        for dst, placed in plan.routes.items():
            placed = np.asarray(placed, np.int64)
            ok = ~np.asarray(plan.waits[dst], bool) if running else np.ones(placed.size, bool)
            dest[placed[ok]] = dst
        keep = (dest[idx] >= 0) & (dest[idx] != origin)
        if keep.all():
            break
        idx = idx[keep]
    return idx


def route_commands(view: WorkingView, plan: RoutingPlan) -> list:
    """Route commands, and the plan's loads and placements written into `view`."""
    cmds = []
    for r, idx in plan.routes.items():
        cmds.append(Route(r, tuple(view.tid[idx].tolist())))
        view.inst[idx] = r
        view.waiting[idx] = plan.waits[r]
    if plan.load is not None:
        view.kv, view.n_run, view.n_wait = (a.copy() for a in plan.load)
    return cmds


__all__ = ["GONE", "RoutingPlan", "SpeculativeState",
           "WorkingView", "apply_commands", "observed_counts", "plan_migration", "plan_sync",
           "route", "route_commands", "snapshot_is_valid", "sync_commands"]
