"""One decision cycle: `decide_cycle(snapshot, state, cfg) -> (state, commands)`.

The loop calls it as `state, cmds = decide_cycle(observe(), state, cfg); act(cmds)`.
Order within a cycle (StaleFlow Alg. 1, extended with Laminar's repack and OrchestrRL's
balancer):

1. Staleness events: Occupy rewarded groups, Abort dropped ones (and, if configured,
   the reserved groups of a head buffer Stuck too long); Consume a Ready head buffer,
   refilled first with the occupied groups the sampler ranks best (staleness.choose_batch),
   when the trainer is idle. These run on every snapshot: they come from the data path,
   not from the rollouts whose view may be stale.
2. Validation against the speculative state P (§5.2 Eq. 1). An invalid snapshot stops
   the cycle here: "the coordinator waits for the next snapshot".
3. Synchronization (Alg. 4), migration (Alg. 5), repack (Laminar Alg. 1), balancing
   (OrchestrRL §4.2), routing (Alg. 3), each on the view the previous ones left.
4. Reserve the groups routing admitted; top up the prompt groups in the TS; update P.

Commands are ordered: an Interrupt (or a Migrate's interrupt) precedes any Route of the
same trajectory, and Pull follows the Interrupt of the rollout's trajectories (§5.2:
"a Route waits until all interrupted trajectories have returned to the TS").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fnrl.config import BalanceConfig, CostModel, RepackConfig, RoutingConfig
from fnrl.policy import staleness as st
from fnrl.policy.balance import plan_balance
from fnrl.policy.repack import plan_repack, repack_due
from fnrl.policy.routing import (SpeculativeState, WorkingView, apply_commands, plan_migration,
                                 plan_sync, route, route_commands, snapshot_is_valid,
                                 sync_commands)
from fnrl.policy.samplers import SAMPLERS
from fnrl.types import (Abort, ClusterSnapshot, Consume, DropGroups, FillPrompts, Interrupt,
                        Migrate, Pull, Route)


@dataclass(frozen=True, kw_only=True)
class CycleConfig:
    staleness: st.StalenessConfig
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    cost: CostModel = field(default_factory=CostModel)
    repack: RepackConfig | None = None
    """None: no repack (StaleFlow alone)."""
    balance: BalanceConfig | None = None
    """None: no reactive balancing."""
    sampler: str = "fifo"
    """Which occupied groups a Consume trains when more than a batch are rewarded
    (fnrl.policy.samplers.SAMPLERS; staleness.choose_batch)."""
    prompt_groups: int | None = None
    """Initial (not yet admitted) groups to keep in the TS. None: one batch. Gap (digest
    gap 9): the paper sizes the TS at (η+1) × batch_size without saying whether in
    prompts or trajectories; admitted groups are bounded by the buffers anyway, so we
    bound only the not-yet-admitted ones, in groups."""

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"CycleConfig.sampler={self.sampler!r}: must be one of "
                             f"{sorted(SAMPLERS)}")
        if self.prompt_groups is not None and self.prompt_groups < 0:
            raise ValueError(f"CycleConfig.prompt_groups={self.prompt_groups!r}: must be >= 0")


@dataclass(frozen=True, eq=False)
class CycleState:
    staleness: st.StalenessState
    speculative: SpeculativeState
    doomed_gids: frozenset[int] = frozenset()   # aborted groups whose trajectories may remain
    repack_due_s: float = 0.0
    repack_seen_ps_version: int = 0
    stuck_since: tuple[int, float] | None = None   # (v_train, time) the head turned Stuck
    moves: Mapping[int, int] = field(default_factory=dict)
    """Times each trajectory (by id) was moved by migration, repack or balancing while
    the trainer was at `moves_v_train` (RoutingConfig.moves_per_step)."""
    moves_v_train: int = 0


def init_cycle_state(cfg: CycleConfig, inst_version_R, *, v_train: int = 0) -> CycleState:
    return CycleState(staleness=st.init_staleness(cfg.staleness, v_train),
                      speculative=SpeculativeState.initial(inst_version_R),
                      repack_seen_ps_version=v_train)


@dataclass(frozen=True)
class CycleReport:
    """What a cycle did, for metrics and the benchmark."""

    valid: bool
    consumed: int | None
    routed: int
    synced: int


def decide_cycle(snap: ClusterSnapshot, state: CycleState,
                 cfg: CycleConfig) -> tuple[CycleState, tuple]:
    """The commands to issue now and the next state (see the module docstring)."""
    state, cmds, _ = decide_cycle_traced(snap, state, cfg)
    return state, cmds


def decide_cycle_traced(snap: ClusterSnapshot, state: CycleState, cfg: CycleConfig,
                        timer=None) -> tuple[CycleState, tuple, CycleReport]:
    """`decide_cycle` plus a report; `timer(name)` (if given) is called after each
    stage, so the benchmark can time stages without this module reading a clock."""
    tick = timer or (lambda name: None)
    cmds: list = []
    for _ in range(snap.skipped_steps):   # before anything reads the buffers' versions
        state = dataclasses.replace(state, staleness=st.step_skipped(state.staleness))
    stale_state, doomed, stuck_since, timed_out = _staleness_events(snap, state, cfg)
    if timed_out:
        cmds.append(DropGroups(timed_out))
    consumed = None
    if snap.trainer_idle and st.buffer_state(stale_state, 0) is st.BufferState.READY:
        sampler = SAMPLERS[cfg.sampler]
        stale_state = st.choose_batch(stale_state, lambda es: sampler(es, len(es)))
        stale_state, batch = st.consume(stale_state)
        consumed = stale_state.v_train - 1
        cmds.append(Consume(consumed, tuple(e.gid for e in batch)))
    state = dataclasses.replace(state, staleness=stale_state, doomed_gids=doomed,
                                stuck_since=stuck_since)
    tick("staleness")
    if not snapshot_is_valid(state.speculative, snap):
        tick("validation")
        return state, tuple(cmds), CycleReport(False, consumed, 0, 0)
    view = WorkingView(snap, st.group_versions(stale_state), cfg.cost)
    moves = state.moves if state.moves_v_train == stale_state.v_train else {}
    if cfg.routing.moves_per_step == 0:
        view.pinned[:] = True
    elif moves:
        capped = [t for t, n in moves.items() if n >= cfg.routing.moves_per_step]
        view.pinned = np.isin(view.tid, np.asarray(capped, np.int64))
    if doomed:
        cmds += _abort_doomed(view, doomed)
        state = dataclasses.replace(state, doomed_gids=frozenset())
    tick("validation")

    empties = st.empty_counts(stale_state)
    synced = plan_sync(view, stale_state, empties, cfg.routing, snap.ps_version)
    cmds += sync_commands(view, synced, snap.ps_version)
    tick("sync")
    if cfg.routing.migrate:
        cmds += plan_migration(view, cfg.routing, stale_state, empties)
    tick("migration")
    if cfg.repack is not None and repack_due(snap.now_s, state.repack_due_s, snap.ps_version,
                                             state.repack_seen_ps_version):
        cmds += plan_repack(view, cfg.repack, snap.ps_version)
        state = dataclasses.replace(state, repack_due_s=snap.now_s + cfg.repack.period_s,
                                    repack_seen_ps_version=snap.ps_version)
    tick("repack")
    if cfg.balance is not None:
        cmds += plan_balance(view, cfg.balance)
    tick("balance")
    plan = route(view, stale_state, empties, cfg.routing.mu,
                 gain_resolution=cfg.routing.gain_resolution, max_routes=cfg.routing.max_routes,
                 policy=cfg.routing.policy)
    cmds = _without_round_trips(cmds + route_commands(view, plan))
    state = dataclasses.replace(state, moves=_count_moves(moves, cmds),
                                moves_v_train=stale_state.v_train)
    if plan.admissions:
        stale_state = st.reserve_many(stale_state, plan.admissions)
    tick("routing")

    target = cfg.staleness.batch_size if cfg.prompt_groups is None else cfg.prompt_groups
    waiting_groups = np.unique(view.gid[(view.inst == -1) & (view.vtraj < 0)])
    admitted = {g for g, _ in plan.admissions}
    fresh = sum(1 for g in waiting_groups.tolist() if g not in admitted)
    if target > fresh:
        cmds.append(FillPrompts(target - fresh))
    state = dataclasses.replace(
        state, staleness=stale_state,
        speculative=apply_commands(state.speculative, cmds, snap.ps_version))
    tick("commit")
    routed = sum(len(v) for v in plan.routes.values())
    return state, tuple(cmds), CycleReport(True, consumed, routed, len(synced))


def _without_round_trips(cmds: list) -> list:
    """`cmds` less every trajectory that a migration interrupts and the cycle's routing
    places back on the rollout it left (balancing or repack, which run after migration,
    changed the view it chose on): it stays where it is, and nothing is sent for it.
    Sync's interrupts (their rollout pulls) return trajectories to the TS by design."""
    pulled = {c.rid for c in cmds if isinstance(c, Pull)}
    left = {(t, c.rid) for c in cmds if isinstance(c, Interrupt) and c.rid not in pulled
            for t in c.tids}
    back = left & {(t, c.rid) for c in cmds if isinstance(c, Route) for t in c.tids}
    if not back:
        return cmds
    out = []
    for c in cmds:
        if isinstance(c, (Interrupt, Route)):
            c = dataclasses.replace(c, tids=tuple(t for t in c.tids if (t, c.rid) not in back))
            if not c.tids:
                continue
        out.append(c)
    return out


def _count_moves(moves: Mapping[int, int], cmds: list) -> Mapping[int, int]:
    """`moves` with one more for every trajectory that a migration's Interrupt (not a
    sync's: its rollout pulls) or a Migrate in `cmds` moves."""
    pulled = {c.rid for c in cmds if isinstance(c, Pull)}
    moved = [t for c in cmds if isinstance(c, Migrate)
             or (isinstance(c, Interrupt) and c.rid not in pulled) for t in c.tids]
    if not moved:
        return moves
    counts = dict(moves)
    for t in moved:
        counts[t] = counts.get(t, 0) + 1
    return counts


def _staleness_events(snap: ClusterSnapshot, state: CycleState, cfg: CycleConfig):
    stale_state = state.staleness
    entries = [e for buf in stale_state.buffers for e in buf]
    tracked = {e.gid for e in entries}
    occupied = {e.gid for e in entries if e.occupied}
    # A rewarded group whose entry was aborted (dropped, or stuck too long) is no longer
    # tracked: it is never consumed, and the data path discards it.
    rewarded = [g for g in snap.rewarded_gids if g in tracked and g not in occupied]
    stale_state = st.occupy_many(stale_state, rewarded)
    dropped = [g for g in dict.fromkeys(snap.dropped_gids) if g in tracked]
    stale_state = st.abort_many(stale_state, dropped)
    doomed = state.doomed_gids | frozenset(snap.dropped_gids)
    stuck_since, late = None, ()
    if st.buffer_state(stale_state, 0) is st.BufferState.STUCK:
        v = stale_state.v_train
        since = state.stuck_since[1] if state.stuck_since and state.stuck_since[0] == v \
            else snap.now_s
        stuck_since = (v, since)
        timeout = cfg.staleness.stuck_timeout_s
        if timeout is not None and snap.now_s - since >= timeout:
            late = tuple(e.gid for e in stale_state.buffers[0] if not e.occupied)
            stale_state = st.abort_many(stale_state, late)
            doomed |= frozenset(late)
            stuck_since = None
    return stale_state, doomed, stuck_since, late


def _abort_doomed(view: WorkingView, doomed: frozenset[int]) -> list:
    """Abort every remaining trajectory of aborted groups (§4.3), wherever it is."""
    hit = np.flatnonzero(np.isin(view.gid, np.fromiter(doomed, np.int64, len(doomed)))
                         & (view.inst >= -1))
    cmds = []
    for r in np.unique(view.inst[hit]).tolist():
        idx = hit[view.inst[hit] == r]
        cmds.append(Abort(None if r < 0 else r, tuple(view.tid[idx].tolist())))
    view.drop(hit)
    return cmds
