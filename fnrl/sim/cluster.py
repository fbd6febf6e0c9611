"""The simulated job: an event heap over a virtual clock that runs the real coordinator.

Each decision cycle is the controller loop's `tick` (fnrl.control.loop): observe the
cluster as a `ClusterSnapshot`, `fnrl.policy.schedule.reconcile` and `.decide` (the
StaleFlow cycle under every preset, with repack, balancing and the sampler), then act
on each command in order. Acting changes the bookkeeping at once, as the real `act`
does; the work it starts (decoding, a pull, a train step) lands later as events on the
heap. Nothing about the policies is reimplemented here: the presets are
`fnrl.experiments.presets`, and the metrics are `fnrl.control.report`'s.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from fnrl.control import report
from fnrl.control.book import Book
from fnrl.policy import schedule
from fnrl.policy.routing import snapshot_is_valid
from fnrl.sim import costs
from fnrl.sim.config import SimConfig
from fnrl.sim.coordinator import plan_for
from fnrl.sim.engine import (CLOCK_RESOLUTION_S, GONE, IN_TS, QUEUED, RUNNING, TOOL, Instance,
                             Trajectories)
from fnrl.sim.workload import group_lengths, tool_latency, turn_ends
from fnrl.types import (Abort, ClusterSnapshot, Consume, DropGroups, Evaluate, FillPrompts,
                        Interrupt, Migrate, Pull, Route)

INST, PULL, TRAIN, TICK, TOOL_RETURN = range(5)     # event kinds
MAX_CYCLES_AT_ONCE = 64                # cycles at one instant (cycle_s = 0) before it is a bug


class StalenessViolation(AssertionError):
    """A consumed batch holds a token older than the bound allows: a coordinator bug."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """What the cluster's GPUs do, and what each movement of weights costs."""

    train_gpus: int
    rollouts: int
    kv_capacity: int
    decode: costs.DecodeCosts
    relay_position: tuple[int, ...]     # per rollout: its relay's place in the chain
    publish_s: float                    # the trainer's stall after each step
    pull_s: float                       # a rollout's load of one version
    relay_arrival_s: tuple[float, ...]  # per rollout: a version reaches its relay after the master
    colocated: bool
    model: costs.ModelSpec
    gpu: costs.GpuSpec
    train: costs.TrainParams


def layout(cfg: SimConfig, table: dict | None = None) -> Layout:
    c, table = cfg.cluster, table or costs.load_table()
    gpu, model = costs.gpu_spec(c.gpu, table), costs.model_spec(c.model, table)
    roof = costs.RooflineParams(**table.get("roofline", {}))
    sync = costs.SyncParams(**table.get("sync", {}))
    colocated = c.placement == "colocated"
    train_gpus = cfg.gpus if colocated else (c.train_gpus or cfg.gpus // 2)
    rollout_gpus = cfg.gpus if colocated else cfg.gpus - train_gpus
    rollouts = rollout_gpus // c.rollout_tp
    if rollouts < 1 or train_gpus < 1:
        raise ValueError(f"invalid config gpus={cfg.gpus}: {train_gpus} trainer GPUs and "
                         f"{rollout_gpus} rollout GPUs make no rollout of tp={c.rollout_tp}")
    # The rollouts' copy: quantized (LlamaRL's fp8 generator) when rollout_dtype_bytes says so.
    served = dataclasses.replace(model, dtype_bytes=c.rollout_dtype_bytes or model.dtype_bytes)
    comm = (costs.tp_allreduce_s(model, gpu, c.rollout_tp, c.gpus_per_machine,
                                 costs.tp_comm_params(table))
            if c.tp_comm else (0.0, 0.0))
    if c.decode == "roofline":
        decode = costs.roofline_decode(served, gpu, c.rollout_tp, roof, comm)
    elif c.decode in table.get("decode", {}):
        # A fitted engine's coefficients; its prefill from the roofline.
        decode = dataclasses.replace(costs.roofline_decode(served, gpu, c.rollout_tp, roof),
                                     cost=costs.named_decode(c.decode, table))
    else:
        decode = costs.load_profiled(c.decode)
    # The engine's share of each GPU and, colocated, the phase switch a step.
    share, switch = c.memory_fraction or roof.kv_memory_fraction, 0.0
    if colocated:
        share, switch = costs.colocated_memory(
            model, served, gpu, tp=c.rollout_tp, gpus=cfg.gpus, fraction=c.memory_fraction,
            offload=c.train_offload, roof=roof, p=costs.ColocatedParams(**table.get("colocated", {})))
    roof = dataclasses.replace(roof, kv_memory_fraction=share)
    kv = c.kv_capacity_tokens or costs.kv_capacity_tokens(served, gpu, c.rollout_tp, roof)
    w = cfg.workload
    if kv < w.prompt_len + w.len_max + 1:
        raise ValueError(f"invalid config cluster.kv_capacity_tokens={kv}: one trajectory "
                         f"({w.prompt_len} + {w.len_max} tokens) does not fit")
    nbytes = served.weight_bytes
    if colocated:
        publish, pull = 0.0, costs.colocated_sync_s(nbytes, c.rollout_tp, sync) + switch
    elif c.weight_sync == "relay":
        publish = costs.publish_stall_s(nbytes, sync)
        pull = costs.relay_pull_s(nbytes, c.rollout_tp, gpu, sync)
    else:   # the trainer waits for its broadcast; each rollout receives over the network
        publish = pull = costs.nccl_sync_s(nbytes, c.rollout_tp, sync)
    machine = [(r * c.rollout_tp) // c.gpus_per_machine for r in range(rollouts)]
    arrive = [costs.chain_arrival_s(nbytes, m, sync) if c.weight_sync == "relay" and not colocated
              else 0.0 for m in machine]
    return Layout(train_gpus=train_gpus, rollouts=rollouts, kv_capacity=int(kv), decode=decode,
                  relay_position=tuple(machine),
                  publish_s=c.publish_s if c.publish_s >= 0 else publish,
                  pull_s=c.pull_s if c.pull_s >= 0 else pull, relay_arrival_s=tuple(arrive),
                  colocated=colocated, model=model, gpu=gpu,
                  train=costs.TrainParams(**{**table.get("train", {}), "mfu": c.train_mfu}))


def steady_throughput(records: list[dict], warmup: int) -> float:
    """Trained prompt + response tokens per second after `warmup` steps: the tokens of
    records[warmup:] over the time from the end of step `warmup` (0: the start) to the
    last step's end."""
    if not records[warmup:]:
        return 0.0
    start = records[warmup - 1]["wall_s"] if warmup > 0 else 0.0
    return sum(r["seq_tokens"] for r in records[warmup:]) / max(records[-1]["wall_s"] - start, 1e-9)


def stream_schedule(done_s: Sequence[float], free_s: float, now: float, piece_s: float,
                    k: int) -> tuple[float, float]:
    """Stream generation's trainer (Laminar Fig. 3c; `ClusterSpec.stream_minibatches`):
    a batch's groups, in the order they finished (`done_s`), trained as k mini-batches of
    `piece_s` each. Mini-batch j starts once its groups are done and the trainer is free
    (`free_s`: the previous step's end, publish included); the last one not before `now`,
    when the controller hands the whole batch over. Returns (first start, last start).

    Gap (ours): the paper does not say how a step's batch splits; equal shares in
    finishing order ("early mini-batches on short trajectories"), each costing 1/k of
    the step, with nothing charged for the extra weight copy it keeps."""
    done = sorted(done_s)
    t, first = free_s, None
    for j in range(k - 1):
        start = max(t, done[math.ceil((j + 1) * len(done) / k) - 1])
        first = start if first is None else first
        t = start + piece_s
    last = max(t, now)
    return (last if first is None else first), last


class Simulation:
    """One simulated run of `cfg`: `run()` returns the summary; `step_records`,
    `timeline` and `consumed_log` hold what the run directory is written from."""

    def __init__(self, cfg: SimConfig, *, writer=None, table: dict | None = None):
        self.cfg, self.writer = cfg, writer
        self.lay = layout(cfg, table)
        self.plan = plan_for(cfg, self.lay.decode)
        self.eta = self.plan.cycle.staleness.eta
        self.trajs = Trajectories()
        self.inst = [Instance(r, self.lay.decode, self.trajs, kv_capacity=self.lay.kv_capacity,
                              max_num_seqs=cfg.cluster.max_num_seqs,
                              hold_kv=cfg.workload.tool_holds_kv)
                     for r in range(self.lay.rollouts)]
        self.book = Book(trainer_version=0, steps_done=0)
        self.state = schedule.init_schedule(self.plan, [0] * self.lay.rollouts, v_train=0, steps_done=0)
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.published = {0: 0.0}             # version -> when the master relay had it
        self.group_left: list[int] = []       # unfinished members per gid
        self.group_done_s: list[float] = []   # when each gid's last member finished
        self.rewarded: list[int] = []
        self.pull_started: dict[int, float] = {}   # rid -> when its Pull was issued
        self.dirty_inst: set[int] = set()
        self.last_cycle, self.tick_at, self.tick_id = -np.inf, None, 0
        self.last_obs = self.last_step = self.last_timeline = 0.0
        self.kv_prev = np.zeros(self.lay.rollouts)
        self.done = False
        self.training: dict = {}              # the train step in flight
        self.train_gen = 0                    # bumps invalidate a rescheduled TRAIN event
        self.slowdown = 1.0                   # cluster.shared_cores: busy roles / cores
        self.seq_tokens = 0                   # trained prompt + response tokens
        self.stats = Counter()                # the simulator's own: events, cycles, decide_s
        self.timeline: list[dict] = []
        self.step_records: list[dict] = []
        self.consumed_log: list[dict] = []    # per consumed batch: version, staleness

    # --- the heap -------------------------------------------------------------------------

    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def reschedule(self) -> None:
        if self.cfg.cluster.shared_cores:
            self.share_cores()
        for r in sorted(self.dirty_inst):
            self.inst[r].admit(self.now)
        for r in sorted(self.dirty_inst):
            inst = self.inst[r]
            inst.gen += 1
            ev = inst.next_event()
            if ev is not None:
                self.push(max(ev[0], self.now), INST, r, inst.gen)
        self.dirty_inst.clear()

    def run(self) -> dict:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        # The real loop starts with a wake pending (set by its start-up evaluation), so
        # its second tick follows the first at once (tests/sim/test_real_loop.py).
        self.cycle()
        if not self.done:
            self.cycle()
        while not self.done:
            if not self.heap:
                raise RuntimeError(f"the simulation stalled at t={self.now:.3f}: no event is "
                                   "pending and the run is not done")
            t = self.heap[0][0]
            self.now, woke = t, False
            # Events within the clock's resolution are simultaneous (as asyncio's loop
            # runs every timer due within its clock resolution in one iteration).
            while self.heap and self.heap[0][0] <= t + CLOCK_RESOLUTION_S:
                _, _, kind, a, b = heapq.heappop(self.heap)
                self.stats["events"] += 1
                woke |= self.handle(kind, a, b)
            self.reschedule()
            if woke:
                self.maybe_cycle()
        self.stats["wall_s"] = time.perf_counter() - wall0
        self.stats["cpu_s"] = time.process_time() - cpu0
        return self.summary()

    def maybe_cycle(self) -> None:
        """Something landed: a cycle now, or at the next tick if one ran too recently."""
        if self.cfg.loop_ticks or self.now >= self.last_cycle + self.cfg.cycle_s:
            self.cycle()
        elif self.tick_at is None:
            self.tick(self.last_cycle + self.cfg.cycle_s)

    def share_cores(self) -> None:
        """Busy roles share the host's cores (ClusterSpec.shared_cores): when their number
        changes the slowdown, the train step in flight is re-timed (the work left, at the
        new speed) and every rollout from its last step boundary (a prefill in progress
        keeps its end). A rollout is busy with a running batch or a queue it will admit."""
        busy = int(self.book.trainer_busy) + sum((i.n > 0 or bool(i.queue)) and not i.pulling
                                                 for i in self.inst)
        f = max(1.0, busy / self.cfg.cluster.shared_cores)
        if f == self.slowdown:
            return
        for r, inst in enumerate(self.inst):
            inst.advance(self.now)
            inst.set_slowdown(f)
            self.dirty_inst.add(r)
        if self.book.trainer_busy:
            p = self.training
            p["end"] = self.now + (p["end"] - self.now) * f / self.slowdown
            self.train_gen += 1
            self.push(p["end"], TRAIN, self.train_gen)
        self.slowdown = f

    def tick(self, at: float) -> None:
        """A cycle at `at` unless something wakes one sooner (supersedes any other)."""
        self.tick_id += 1
        self.tick_at = at
        self.push(at, TICK, self.tick_id)

    def handle(self, kind: int, a: int, b: int) -> bool:
        """Applies one event; True if it wakes the loop (as a landed task does)."""
        if kind == INST:
            inst = self.inst[a]
            if b != inst.gen:
                return False
            finished = inst.on_event(self.now, inst.pending_step)
            for tid in finished:
                gid = int(self.trajs.gid[tid])
                self.group_left[gid] -= 1
                if self.group_left[gid] == 0:
                    self.rewarded.append(gid)
                    self.group_done_s[gid] = self.now
            for tid in inst.tool_calls:
                self.call_tool(tid)
            inst.tool_calls.clear()
            self.dirty_inst.add(a)
            return bool(finished)
        if kind == PULL:
            inst = self.inst[a]
            t0 = self.pull_started.pop(a)
            inst.end_pull(self.now, b)
            for tid in inst.queue:
                self._continues(a, tid)
            self.book.time["pull_s"] += self.now - t0
            self.event("pull", t0, rid=a, version=b)
            self.dirty_inst.add(a)
            return True
        if kind == TRAIN:
            return a == self.train_gen and self.train_done()
        if kind == TOOL_RETURN:
            self.tool_returned(a)
            return False
        if a != self.tick_id:   # TICK: superseded by a later one
            return False
        self.tick_at = None
        return True

    # --- observe → decide → act ------------------------------------------------------------

    def cycle(self) -> None:
        for _ in range(MAX_CYCLES_AT_ONCE):
            self.last_cycle = self.now
            self.stats["cycles"] += 1
            snap = self.observe()
            if schedule.finished(self.state, self.plan, trainer_idle=not self.book.trainer_busy):
                self.done = True
                return
            t0, c0 = time.perf_counter(), time.process_time()
            pulling = any(i.pulling for i in self.inst)
            self.state, reset = schedule.reconcile(self.state, snap, pulls_in_flight=pulling)
            self.book.counts["speculative_resets"] += reset
            speculative = self.state.cycle.speculative
            self.state, cmds = schedule.decide(snap, self.state, self.plan)
            self.stats["decide_s"] += time.perf_counter() - t0
            self.stats["decide_cpu_s"] += time.process_time() - c0
            # Cycles that stopped at validation (a pull in flight): they only Consume.
            self.stats["invalid_cycles"] += not snapshot_is_valid(speculative, snap)
            for cmd in cmds:
                self.act(cmd)
            self.reschedule()
            if self.cfg.loop_ticks:   # the loop's idle tick, one TICK_S after this one
                self.tick(self.now + self.cfg.cycle_s)
                if cmds and self.cfg.cycle_s == 0:
                    continue
                return
            if not cmds:
                return
            if self.cfg.cycle_s > 0:   # the loop ticks again to follow up on its commands
                if self.tick_at is None:
                    self.tick(self.now + self.cfg.cycle_s)
                return
        raise RuntimeError(f"{MAX_CYCLES_AT_ONCE} cycles at t={self.now} each issued commands")

    def observe(self):
        now, tr, R = self.now, self.trajs, self.lay.rollouts
        for inst in self.inst:
            inst.advance(now)
        n = tr.n
        live = np.flatnonzero(tr.state[:n] != GONE)
        inst_of, state = tr.inst[live], tr.state[live]
        step_R = np.fromiter((i.step for i in self.inst), np.int64, R)
        running = state == RUNNING
        made = np.where(running, np.maximum(step_R[np.maximum(inst_of, 0)] - tr.join_step[live], 0), 0)
        length = tr.prompt[live] + tr.gen[live] + made
        kv_used = np.bincount(inst_of[running], weights=length[running], minlength=R)[:R]
        dt, self.last_obs = now - self.last_obs, now
        placed = np.bincount(inst_of[inst_of >= 0], minlength=R)[:R]
        for r, inst in enumerate(self.inst):
            inst.active_s += dt * bool(placed[r])
            inst.kv_token_s += dt * float(kv_used[r])
        snap = ClusterSnapshot(
            now_s=now, ps_version=self.book.trainer_version, trainer_idle=not self.book.trainer_busy,
            inst_version_R=np.fromiter((i.version for i in self.inst), np.int64, R),
            inst_kv_used_R=kv_used.astype(np.float64), inst_kv_prev_R=self.kv_prev,
            inst_kv_capacity_R=np.full(R, float(self.lay.kv_capacity)),
            inst_num_complete_R=np.fromiter((i.complete for i in self.inst), np.int64, R),
            traj_id_N=live, traj_gid_N=tr.gid[live], traj_inst_N=np.where(state == IN_TS, -1, inst_of),
            traj_waiting_N=state == QUEUED, traj_len_N=length,
            rewarded_gids=tuple(self.rewarded),
            inst_max_seqs_R=np.full(R, self.cfg.cluster.max_num_seqs, np.int64))
        self.rewarded = []
        self.kv_prev = kv_used.astype(np.float64)
        if now - self.last_timeline >= self.cfg.timeline_dt_s or not self.timeline:
            self.last_timeline = now
            k = self.cfg.timeline_rollouts
            self.timeline.append({"t": now, "running": placed[:k].tolist(),
                                  "versions": snap.inst_version_R[:k].tolist(),
                                  "trainer_busy": self.book.trainer_busy})
        return snap

    def act(self, cmd) -> None:
        counts, tr = self.book.counts, self.trajs
        if isinstance(cmd, FillPrompts):
            self.fill(cmd.num_groups)
        elif isinstance(cmd, Route):
            for tid in cmd.tids:
                assert tr.state[tid] == IN_TS, (tid, tr.state[tid])
                self._continues(cmd.rid, tid)
                self._place(cmd.rid, tid)
            self.dirty_inst.add(cmd.rid)
            counts["routed"] += len(cmd.tids)
        elif isinstance(cmd, Interrupt):
            self._leave(cmd.rid, cmd.tids)
            counts["interrupted"] += len(cmd.tids)
        elif isinstance(cmd, Migrate):
            self._leave(cmd.src, cmd.tids)
            for tid in cmd.tids:
                self._continues(cmd.dst, tid)
                self._place(cmd.dst, tid)
            self.dirty_inst.add(cmd.dst)
            report.count_migrate(counts, cmd)
        elif isinstance(cmd, Abort):
            if cmd.rid is not None:
                self._leave(cmd.rid, cmd.tids)
            tr.state[list(cmd.tids)] = GONE
            counts["aborted"] += len(cmd.tids)
        elif isinstance(cmd, DropGroups):
            counts["dropped_groups"] += len(cmd.gids)
        elif isinstance(cmd, Pull):
            self.pull(cmd.rid)
        elif isinstance(cmd, Consume):
            self.consume(cmd)
        elif isinstance(cmd, Evaluate):
            counts["evals_skipped"] += 1   # the simulator has no held-out set
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _continues(self, rid: int, tid: int) -> None:
        """Counts a placement that continues streamed tokens when its request starts, as
        the loop does: now, or when the rollout's pull lands (if it is still there)."""
        if self.trajs.gen[tid] and not self.inst[rid].pulling:
            self.book.counts["continued"] += 1
            self.book.counts["reprefill_tokens"] += self.trajs.context(tid)

    def _leave(self, rid: int, tids) -> None:
        inst = self.inst[rid]
        inst.advance(self.now)
        for tid in tids:
            assert self.trajs.inst[tid] == rid and self.trajs.state[tid] in (QUEUED, RUNNING, TOOL), tid
            inst.remove(tid)
        self.dirty_inst.add(rid)

    def _place(self, rid: int, tid: int) -> None:
        """Queues a placed trajectory, or parks it until its tool call returns."""
        if self.trajs.tool_until[tid] > self.now + CLOCK_RESOLUTION_S:
            self.inst[rid].await_tool(tid)
        else:
            self.inst[rid].enqueue(tid)

    def call_tool(self, tid: int) -> None:
        """A turn ended: its tool call returns after the workload's latency."""
        tr = self.trajs
        call = sum(e <= tr.gen[tid] for e in turn_ends(int(tr.target[tid]), int(tr.turns[tid])))
        self.stats["tool_calls"] += 1
        t = self.now + tool_latency(self.cfg.workload, self.cfg.seed, tid, call)
        tr.tool_until[tid] = t
        self.push(t, TOOL_RETURN, tid)

    def tool_returned(self, tid: int) -> None:
        """The observation joins its context; its engine resumes it (if it is placed)."""
        tr = self.trajs
        tr.prompt[tid] += self.cfg.workload.tool_tokens
        if tr.state[tid] == TOOL:
            rid = int(tr.inst[tid])
            self.inst[rid].tool_returned(tid)
            self.dirty_inst.add(rid)

    def fill(self, num_groups: int) -> None:
        w, G = self.cfg.workload, self.cfg.workload.group_size
        total = self.cfg.steps * w.groups_per_step
        for _ in range(num_groups):
            gid = len(self.group_left)
            lengths = group_lengths(w, self.cfg.seed, gid, gid / total)
            self.trajs.add(gid, w.prompt_len, lengths, w.turns)
            self.group_left.append(G)
            self.group_done_s.append(np.inf)

    def pull(self, rid: int) -> None:
        inst, v = self.inst[rid], self.book.trainer_version
        self.book.counts["pulls"] += 1
        inst.advance(self.now)
        inst.begin_pull()
        inst.complete = 0
        # The version reaches this rollout's relay down the chain after the master has it.
        start = max(self.now, self.published[v] + self.lay.relay_arrival_s[rid])
        self.pull_started[rid] = self.now
        self.push(start + self.lay.pull_s, PULL, rid, v)
        self.dirty_inst.add(rid)

    def _count_generated(self) -> None:
        """Generated tokens so far: those settled into segments (finished, interrupted,
        preempted), counted when a step's record is written."""
        self.book.generated_tokens = int(self.trajs.gen[:self.trajs.n].sum())

    def consume(self, cmd: Consume) -> None:
        book, tr = self.book, self.trajs
        if cmd.version != book.trainer_version:
            raise StalenessViolation(f"Consume names version {cmd.version} but the trainer "
                                     f"is at {book.trainer_version}")
        G = self.cfg.workload.group_size
        seq_lens, hist, checked, worst = [], Counter(), 0, 0
        for gid in cmd.gids:
            for tid in range(gid * G, gid * G + G):
                for version, made in tr.segments[tid]:
                    # StaleFlow §4.2 on every consumed token: V_token + η ≥ V_buf.
                    if version + self.eta < cmd.version:
                        raise StalenessViolation(
                            f"group {gid} has {made} tokens of version {version}, too old for "
                            f"buffer {cmd.version} (η={self.eta})")
                    hist[cmd.version - version] += made
                    checked += made
                    worst = max(worst, cmd.version - version)
                seq_lens.append(int(tr.prompt[tid] + tr.gen[tid]))
        c = self.cfg.cluster
        train_s = c.train_step_s or costs.train_step_s(self.lay.model, self.lay.gpu,
                                                       self.lay.train_gpus, seq_lens, self.lay.train)
        book.trainer_busy = True
        # `tokens` is the job's: response tokens (the loss mask); the seeds count prompt
        # and response tokens (`seq_tokens`).
        members = np.concatenate([np.arange(g * G, g * G + G) for g in cmd.gids])
        responses = tr.gen[members]
        hist_list = [hist.get(k, 0) for k in range(max(hist, default=0) + 1)]
        self.training = {"tokens": int(responses.sum()), "seq_tokens": int(sum(seq_lens)),
                         "t0": self.now, "handed": self.now, "train_s": train_s,
                         "staleness_hist": hist_list,
                         "checked": checked, "worst": worst, "groups": len(cmd.gids),
                         "version": cmd.version, "response_len_mean": float(responses.mean())}
        self.consumed_log.append({"version": cmd.version, "staleness_max": worst,
                                  "checked_tokens": checked})
        k = c.stream_minibatches
        if k > 1:   # the early mini-batches were trained while the batch filled
            first, last = stream_schedule([self.group_done_s[g] for g in cmd.gids],
                                          book.last_train_end_s, self.now, train_s / k, k)
            self.training.update(t0=first, busy_s=train_s + self.lay.publish_s,
                                 end=last + train_s / k + self.lay.publish_s)
        else:
            self.training["end"] = self.now + (train_s + self.lay.publish_s) * self.slowdown
        self.push(self.training["end"], TRAIN, self.train_gen)

    def train_done(self) -> bool:
        book, p = self.book, self.training
        self._count_generated()
        book.time["train_call_s"] += p.get("busy_s", self.now - p["t0"])
        book.last_train_end_s = self.now
        self.event("train", p["t0"], version=p["version"], handed=p["handed"])
        book.trainer_version += 1
        book.steps_done += 1
        book.trained_tokens += p["tokens"]
        self.seq_tokens += p["seq_tokens"]
        book.checked_tokens += p["checked"]
        book.max_staleness = max(book.max_staleness, p["worst"])
        book.counts["consumed_groups"] += p["groups"]
        book.trainer_busy = False
        self.published[book.trainer_version] = self.now
        hist = np.asarray(p["staleness_hist"], float)
        mean = float(hist @ np.arange(len(hist)) / max(hist.sum(), 1))
        stats = {"tokens": p["tokens"], "seq_tokens": p["seq_tokens"], "staleness_mean": mean,
                 "staleness_max": p["worst"], "staleness_hist": p["staleness_hist"],
                 "response_len_mean": p["response_len_mean"], "eta": self.eta,
                 "staleness_checked_tokens": p["checked"], "staleness_checked_max": p["worst"]}
        record = report.step_record(book, self.inst, {"train_step_s": p["train_s"]}, stats,
                                    preset=self.cfg.preset, wall_s=self.now,
                                    since_last_step_s=self.now - self.last_step)
        record["preemptions"] = sum(i.preemptions for i in self.inst)
        self.last_step = self.now
        self.step_records.append(record)
        if self.writer is not None:
            self.writer.write("train", book.trainer_version, record)
        return True

    def event(self, name: str, t0: float, **fields) -> None:
        if "rid" in fields and fields["rid"] >= self.cfg.timeline_rollouts:
            return
        self.timeline.append({"t": self.now, "t0": t0, "event": name, **fields})

    # --- summary --------------------------------------------------------------------------

    def summary(self) -> dict:
        b, wall = self.book, self.now
        self._count_generated()
        train_wall = max(b.last_train_end_s, 1e-9)
        # The steady step: between the first and the last step's end (a pipeline's first
        # step also waits for its first batch).
        ends = [t for v, t in sorted(self.published.items()) if v >= 1]
        step_s = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else train_wall
        busy = np.array([i.busy_s for i in self.inst])
        return {"preset": self.cfg.preset, "gpus": self.cfg.gpus, "steps": b.steps_done,
                "train_wall_s": train_wall, "trained_tokens_per_s": b.trained_tokens / train_wall,
                "trained_seq_tokens": self.seq_tokens,
                "trained_seq_tokens_per_s": self.seq_tokens / train_wall,
                "steady_seq_tokens_per_s": steady_throughput(self.step_records, self.cfg.warmup_steps),
                "version": b.trainer_version, "trained_tokens": b.trained_tokens,
                "step_s": step_s,
                "generated_tokens": b.generated_tokens, "staleness_checked_tokens": b.checked_tokens,
                "staleness_checked_max": b.max_staleness, "eta": self.eta,
                **{k: b.counts[k] for k in report.COUNT_KEYS},
                **report.utilization(b, self.inst, wall),
                "rollout_decode_idle_frac": float(np.mean(1.0 - np.minimum(busy / max(wall, 1e-9), 1.0))),
                "preemptions": sum(i.preemptions for i in self.inst),
                "engine_prefill_tokens": sum(i.prefill_tokens for i in self.inst),
                "train_gpus": self.lay.train_gpus, "rollouts": self.lay.rollouts,
                "rollout_gpus": self.lay.rollouts * self.cfg.cluster.rollout_tp,
                "kv_capacity_tokens": self.lay.kv_capacity, "publish_s": self.lay.publish_s,
                "pull_s": self.lay.pull_s, "cost_model": dataclasses.asdict(self.lay.decode.cost),
                "trajectories": self.trajs.n, "tool_calls": self.stats["tool_calls"],
                "sim_events": self.stats["events"], "sim_cycles": self.stats["cycles"],
                "sim_decide_s": self.stats["decide_s"],
                "sim_invalid_cycles": self.stats["invalid_cycles"],
                "sim_decide_cpu_s": self.stats["decide_cpu_s"], "sim_cpu_s": self.stats["cpu_s"],
                "sim_wall_s": self.stats["wall_s"]}
