"""Time one full decision cycle (validation, staleness, sync, migration, repack,
balancing, routing) over 1,024 rollouts and 16,384 in-flight trajectories.

Budget: 10 ms per cycle (StaleFlow reports its Alg. 1 "typically under 0.1s"; Laminar's
repack takes 0.69 s). Two snapshots, timed side by side:
  steady  a running job: η = 3, 256 groups of 16 per step, rollouts on 4 versions, the
          buffers full of reservations, some rollouts behind the trainer (lazy sync
          runs its tentative routing), some wait queues overflowing (migration), some
          rollouts ramping down (repack), groups finishing (Occupy), prompts waiting.
  consume the same job at the moment the head buffer's last groups finish: Occupy 256
          groups, Consume, admit new groups (routing capped at RoutingConfig.max_routes).
  cold    the first cycle of a job: every trajectory in the TS, every rollout idle,
          empty buffers: the most routing one cycle can do (capped the same way).

    python -m lab.benchmarks.policy_cycle [--cycles 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from fnrl.config import BalanceConfig, RepackConfig, RoutingConfig
from fnrl.policy import staleness as st
from fnrl.policy.cycle import (CycleConfig, CycleState, decide_cycle, decide_cycle_traced,
                               init_cycle_state)
from fnrl.policy.routing import SpeculativeState
from fnrl.types import ClusterSnapshot, Route

R, G, BATCH, ETA, V_TRAIN = 1024, 16, 256, 3, 10
N_TARGET = 16_384
BUDGET_MS = 10.0
STAGES = ("staleness", "validation", "sync", "migration", "repack", "balance", "routing",
          "commit")


def config() -> CycleConfig:
    return CycleConfig(staleness=st.StalenessConfig(eta=ETA, batch_size=BATCH),
                       repack=RepackConfig(), balance=BalanceConfig())


def steady(rng, *, consume: bool = False) -> tuple[ClusterSnapshot, CycleState]:
    """A running job, made by letting the cycle place a cold start, then time passing:
    tokens were generated (some rollouts overflow into wait queues), 16 groups finished
    (rewarded this cycle), 8 rollouts were interrupted (their trajectories wait in the
    TS), 20% of rollouts ramp down, fresh prompt groups replace the finished ones, and a
    quarter of the rollouts serve the newest version while the rest lag 1-3 versions.
    consume=True: the 256 groups of the head buffer finished instead, so the cycle
    Occupies them, Consumes, and admits new groups into the freed buffer."""
    cfg = config()
    versions = np.repeat(np.arange(V_TRAIN - ETA, V_TRAIN + 1), R // (ETA + 1))
    snap0, _ = cold(rng, versions=versions, ps_version=V_TRAIN)
    state = init_cycle_state(cfg, versions, v_train=V_TRAIN)
    place_all = dataclasses.replace(cfg, routing=RoutingConfig(max_routes=None))
    state, cmds = decide_cycle(snap0, state, place_all)
    inst = snap0.traj_inst_N.copy()
    for c in cmds:
        if isinstance(c, Route):
            inst[list(c.tids)] = c.rid
    gids, length = snap0.traj_gid_N, snap0.traj_len_N.copy()
    placed = inst >= 0
    length[placed] += rng.integers(0, 16_000, size=int(placed.sum()))
    inst[np.isin(inst, rng.choice(R, size=8, replace=False))] = -1
    admitted = np.unique(gids[placed])
    done = (np.array([e.gid for e in state.staleness.buffers[0]]) if consume
            else rng.choice(admitted, size=16, replace=False))
    complete = np.bincount(inst[np.isin(gids, done) & (inst >= 0)], minlength=R)
    keep = ~np.isin(gids, done)
    fresh = 10_000 + np.repeat(np.arange((~keep).sum() // G), G)
    gids = np.r_[gids[keep], fresh]
    inst = np.r_[inst[keep], np.full(len(fresh), -1)]
    length = np.r_[length[keep], rng.integers(256, 2048, size=len(fresh))]
    N = len(gids)
    cap = snap0.inst_kv_capacity_R
    waiting = np.zeros(N, bool)
    kv = np.zeros(R)
    for i in np.flatnonzero(inst >= 0)[rng.permutation(int((inst >= 0).sum()))].tolist():
        r = inst[i]
        if kv[r] + length[i] <= cap[r]:
            kv[r] += length[i]
        else:
            waiting[i] = True
    kv_prev = kv * np.where(rng.random(R) < 0.2, 1.3, 0.98)
    snap = ClusterSnapshot(
        now_s=100.0, ps_version=V_TRAIN, trainer_idle=True, inst_version_R=versions,
        inst_kv_used_R=kv, inst_kv_prev_R=kv_prev, inst_kv_capacity_R=cap,
        inst_num_complete_R=complete, traj_id_N=np.arange(N), traj_gid_N=gids,
        traj_inst_N=inst, traj_waiting_N=waiting, traj_len_N=length,
        rewarded_gids=tuple(done.tolist()))
    state = dataclasses.replace(state, speculative=SpeculativeState.from_snapshot(snap))
    return snap, state


def cold(rng, *, versions=None, ps_version=0) -> tuple[ClusterSnapshot, CycleState]:
    cfg = config()
    versions = np.zeros(R, np.int64) if versions is None else versions
    N = N_TARGET
    gids = np.repeat(np.arange(N // G), G)
    snap = ClusterSnapshot(
        now_s=0.0, ps_version=ps_version, trainer_idle=True, inst_version_R=versions,
        inst_kv_used_R=np.zeros(R), inst_kv_prev_R=np.zeros(R),
        inst_kv_capacity_R=np.full(R, 200_000.0), inst_num_complete_R=np.zeros(R, np.int64),
        traj_id_N=np.arange(N), traj_gid_N=gids, traj_inst_N=np.full(N, -1),
        traj_waiting_N=np.zeros(N, bool), traj_len_N=np.repeat(rng.integers(256, 2048, N // G), G))
    return snap, init_cycle_state(cfg, versions, v_train=ps_version)


def time_cycles(snap, state, cycles: int):
    """Median wall and CPU (thread) time per cycle and per stage. CPU time is reported
    too because shared machines time-slice: wall time then includes other jobs' turns."""
    cfg = config()
    wall, cpu, per_stage = [], [], {k: [] for k in STAGES}
    for _ in range(cycles):
        marks = []
        w0, c0 = time.perf_counter(), time.thread_time()
        _, cmds, report = decide_cycle_traced(
            snap, state, cfg, timer=lambda name: marks.append((name, time.thread_time())))
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
        prev = c0
        for name, t in marks:
            per_stage[name].append((t - prev) * 1e3)
            prev = t
    kinds = {}
    for c in cmds:
        kinds[type(c).__name__] = kinds.get(type(c).__name__, 0) + 1
    return (float(np.median(wall)), float(np.median(cpu)),
            {k: float(np.median(v)) for k, v in per_stage.items() if v}, report, kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    scenarios = (("steady", steady), ("consume", lambda rng: steady(rng, consume=True)),
                 ("cold", cold))
    for name, build in scenarios:
        snap, state = build(rng)
        wall, total, stages, report, kinds = time_cycles(snap, state, args.cycles)
        print(f"{name}: {snap.num_rollouts} rollouts, {len(snap.traj_id_N)} trajectories "
              f"({int((snap.traj_inst_N == -1).sum())} in the TS); valid={report.valid} "
              f"routed={report.routed} synced={report.synced} consumed={report.consumed}")
        print(f"  commands: {kinds}")
        print(f"  cycle {total:.2f} ms CPU = {total / BUDGET_MS:.2f} x the {BUDGET_MS:g} ms "
              f"budget; {wall:.2f} ms wall (medians of {args.cycles})")
        for k, v in stages.items():
            print(f"    {k:<10} {v:7.3f} ms CPU  {v / total:6.1%}")


if __name__ == "__main__":
    main()
