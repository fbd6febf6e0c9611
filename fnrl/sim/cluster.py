"""The simulated job: an event heap over a virtual clock that runs the real coordinator.

Each decision cycle is the controller loop's `tick` (fnrl.control.loop): observe the
cluster as a `ClusterSnapshot`, `fnrl.policy.schedule.reconcile` and `.decide` (the
StaleFlow cycle under every preset, with repack, balancing and the sampler), then act
on each command in order. Acting changes the bookkeeping at once, as the real `act`
does; the work it starts (decoding, a pull, a train step) lands later as events on the
heap. Nothing about the policies is reimplemented here: the presets are
`fnrl.config.presets`, and the metrics are `fnrl.control.report`'s.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter

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
from fnrl.sim.layout import layout, stream_schedule
from fnrl.sim.reconfig import replanner_for
from fnrl.sim.summary import summarize
from fnrl.sim.workload import group_lengths, tool_latency, turn_ends
from fnrl.types import (Abort, ClusterSnapshot, Consume, DropGroups, Evaluate, FillPrompts,
                        Interrupt, Migrate, Pull, Reconfigure, Route)

INST, PULL, TRAIN, TICK, TOOL_RETURN, MODE_UP = range(6)     # event kinds
MAX_CYCLES_AT_ONCE = 64                # cycles at one instant (cycle_s = 0) before it is a bug


class StalenessViolation(AssertionError):
    """A consumed batch holds a token older than the bound allows: a coordinator bug."""


class Simulation:
    """One simulated run of `cfg`: `run()` returns the summary; `step_records`,
    `timeline` and `consumed_log` hold what the run directory is written from."""

    def __init__(self, cfg: SimConfig, *, writer=None, table: dict | None = None):
        self.cfg, self.writer, self.table = cfg, writer, table
        self.lay = layout(cfg, table)
        self.plan = plan_for(cfg, self.lay.decode, table)
        self.eta = self.plan.cycle.staleness.eta
        self.trajs = Trajectories()
        self.commands = costs.command_costs(table)   # None: commands cost nothing
        self.inst = [Instance(r, m.decode, self.trajs, kv_capacity=m.kv_capacity,
                              max_num_seqs=cfg.cluster.max_num_seqs,
                              hold_kv=cfg.workload.tool_holds_kv, commands=self.commands)
                     for m in self.lay.modes for r in m.rids]
        # Rollout modes (ClusterSpec.rollout_modes): only the current mode's instances are up.
        self.mode = self.lay.modes[0]
        self.up = np.zeros(self.lay.rollouts, bool)
        self.up[self.mode.rids] = True
        self.cap_R = np.array([i.cap for i in self.inst])
        self.tp_R = np.array([m.tp for m in self.lay.modes for _ in m.rids])
        self.pull_R = [m.pull_s for m in self.lay.modes for _ in m.rids]
        self.replanner = replanner_for(cfg, self.lay)
        self.switching = None                 # (mode, weights' version) while a switch runs
        self.book = Book(trainer_version=0, steps_done=0)
        self.state = schedule.init_schedule(self.plan, [0] * self.lay.rollouts, v_train=0, steps_done=0)
        self.heap: list = []
        self.seq, self.now = 0, 0.0
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
        self.train_slowdown = 1.0             # cluster.shared_cores: the train step's
        self.inst_slowdown = 1.0              # ... and each rollout's decode
        self.corun = costs.load_corun(cfg.cluster.corun) if cfg.cluster.corun else None
        self.trained_buckets: set[int] = set()   # cluster.train_bucket_s: first uses
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
        """Busy roles share the host's cores (ClusterSpec.shared_cores) thread by thread:
        the trainer in a step runs `trainer_threads` threads, a busy rollout one, and when
        there are more threads than cores each gets cores / threads of one. A rollout's
        decode is timed as profiled (DecodeCosts.servers side by side), the train step on
        min(threads, cores) cores (as it runs alone); the serial part of a step (a first
        use's load, ClusterSpec.train_bucket_s) runs one thread. With a co-run table
        (ClusterSpec.corun) the step's other work and the decode are slowed by the
        measured factors instead. When a factor changes, the train step in flight is
        re-timed (the work left, at the new speed) and every rollout from its last step
        boundary (a prefill in progress keeps its end). A rollout is busy with a running
        batch or a queue it will admit."""
        c, n0 = self.cfg.cluster, self.lay.decode.servers   # the decode is one of n0's
        servers = sum((i.n > 0 or bool(i.queue)) and not i.pulling for i in self.inst)
        busy = self.book.trainer_busy
        load = c.host_load if servers else 0.0           # roles not simulated, beside them
        threads = c.trainer_threads * int(busy) + servers + load
        serial = max(1.0, (int(busy) + servers + load) / c.shared_cores)   # one trainer thread
        if self.corun is None:
            f_inst = max(1.0, threads / c.shared_cores)    # 1 / each thread's share of a core
            f_par = min(c.trainer_threads, c.shared_cores) * f_inst / c.trainer_threads
            f_inst /= max(1.0, n0 / c.shared_cores)
        else:
            f_inst = self.corun.server_factor(servers, busy) / self.corun.server_factor(n0, False)
            f_par = self.corun.trainer_factor(servers)
        frac = self.training.get("serial_frac", 0.0) if busy else 0.0
        f_train = frac * serial + (1.0 - frac) * f_par
        if f_inst != self.inst_slowdown:
            for r, inst in enumerate(self.inst):
                inst.advance(self.now)
                inst.set_slowdown(f_inst)
                self.dirty_inst.add(r)
            self.inst_slowdown = f_inst
        if f_train != self.train_slowdown:
            if busy:
                p = self.training
                p["end"] = self.now + (p["end"] - self.now) * f_train / self.train_slowdown
                self.train_gen += 1
                self.push(p["end"], TRAIN, self.train_gen)
            self.train_slowdown = f_train

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
            self.trajs.done_s[finished] = self.now
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
        if kind == MODE_UP:
            self.mode_up()
            return True
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
            if self.replanner is not None and self.switching is None:
                gen = snap.traj_len_N - self.trajs.prompt[snap.traj_id_N]
                cmd = self.replanner(self.now, self.mode.tp, gen, snap.traj_len_N)
                if cmd is not None:
                    self.act(cmd)
                    snap = self.observe()
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
            inst_kv_capacity_R=np.where(self.up, self.cap_R, 0.0),
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
        report.count_command(counts, cmd)
        if isinstance(cmd, FillPrompts):
            self.fill(cmd.num_groups)
        elif isinstance(cmd, Route):
            assert self.up[cmd.rid], f"routed to rollout {cmd.rid}, which is down"
            self._send(cmd.rid)
            for tid in cmd.tids:
                assert tr.state[tid] == IN_TS, (tid, tr.state[tid])
                if tr.routed_s[tid] < 0:
                    tr.routed_s[tid] = self.now
                self._continues(cmd.rid, tid)
                self._place(cmd.rid, tid)
            self.dirty_inst.add(cmd.rid)
        elif isinstance(cmd, Interrupt):
            self._leave(cmd.rid, cmd.tids)
        elif isinstance(cmd, Migrate):
            assert self.up[cmd.dst], f"migrated to rollout {cmd.dst}, which is down"
            self._leave(cmd.src, cmd.tids)
            self._send(cmd.dst)
            for tid in cmd.tids:
                self._continues(cmd.dst, tid)
                self._place(cmd.dst, tid)
            self.dirty_inst.add(cmd.dst)
        elif isinstance(cmd, Abort):
            if cmd.rid is not None:
                self._leave(cmd.rid, cmd.tids)
            tr.state[list(cmd.tids)] = GONE
        elif isinstance(cmd, DropGroups):
            pass   # counted; the simulator keeps no group table to drop from
        elif isinstance(cmd, Pull):
            self.pull(cmd.rid)
        elif isinstance(cmd, Consume):
            self.consume(cmd)
        elif isinstance(cmd, Reconfigure):
            self.reconfigure(cmd.tp)
        elif isinstance(cmd, Evaluate):
            counts["evals_skipped"] += 1   # the simulator has no held-out set
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def reconfigure(self, tp: int) -> None:
        """OrchestrRL's switch (§6.3): the current mode's trajectories go back to the
        trajectory server with their tokens, its instances go down, and the new mode's
        come up `switch_s` later with the weights the GPUs held."""
        old, new = self.mode, next(m for m in self.lay.modes if m.tp == tp)
        tr, n = self.trajs, self.trajs.n
        for r in old.rids:
            placed = np.flatnonzero((tr.inst[:n] == r) & np.isin(tr.state[:n], (QUEUED, RUNNING, TOOL)))
            self._leave(r, placed.tolist())
            self.book.counts["interrupted"] += len(placed)
        self.up[old.rids] = False
        self.switching = (new, max(self.inst[r].version for r in old.rids))
        self.stats["reconfigures"] += 1
        self.event("reconfigure", self.now, tp_from=old.tp, tp_to=tp)
        self.push(self.now + self.cfg.cluster.switch_s, MODE_UP)

    def mode_up(self) -> None:
        (new, version), self.switching = self.switching, None
        for r in new.rids:
            inst = self.inst[r]
            inst.advance(self.now)
            inst.end_pull(self.now, max(inst.version, version))
            self.dirty_inst.add(r)
        self.up[new.rids] = True
        self.mode = new
        if self.cfg.coord_cost == "engine":   # the coordinator plans on the new mode's decode
            self.plan = plan_for(self.cfg, new.decode, self.table)

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
        inst.released(len(tids))
        self.dirty_inst.add(rid)

    def _send(self, rid: int) -> None:
        """Requests for rollout `rid` reach it after this cycle's decide and one RPC."""
        if self.commands is not None:
            inst = self.inst[rid]
            inst.not_before = max(inst.not_before, self.now + self.commands.land_s)

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
        if not self.up[rid]:   # a mode that is down loads the weights it holds when it comes up
            inst.version = v
            self.book.counts["pulls_skipped_down"] += 1
            return
        self.book.counts["pulls"] += 1
        inst.advance(self.now)
        # With command costs the load starts once the request has landed and the step in
        # flight has ended (its streams closed), as the loop's pull waits for them.
        landed = self.now if self.commands is None else max(
            self.now + self.commands.land_s, inst.step_end)
        inst.begin_pull()
        inst.complete = 0
        # The version reaches this rollout's relay down the chain after the master has it.
        start = max(landed, self.published[v] + self.lay.relay_arrival_s[rid])
        self.pull_started[rid] = self.now
        self.push(start + self.pull_R[rid], PULL, rid, v)
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
        serial_s = 0.0
        if c.train_bucket_s:
            train_s, serial_s = self.bucket_call_s(max(seq_lens) - 1)
        else:
            train_s = c.train_step_s or costs.train_step_s(
                self.lay.model, self.lay.gpu, self.lay.train_gpus, seq_lens, self.lay.train)
        book.trainer_busy = True
        # `tokens` is the job's: response tokens (the loss mask); the seeds count prompt
        # and response tokens (`seq_tokens`).
        members = np.concatenate([np.arange(g * G, g * G + G) for g in cmd.gids])
        responses = tr.gen[members]
        if self.replanner is not None:
            self.replanner.record(responses)
        hist_list = [hist.get(k, 0) for k in range(max(hist, default=0) + 1)]
        self.training = {"serial_frac": serial_s / max(train_s + self.lay.publish_s, 1e-12),
                         "tokens": int(responses.sum()), "seq_tokens": int(sum(seq_lens)),
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
            self.training["end"] = self.now + (train_s + self.lay.publish_s) * self.train_slowdown
        self.push(self.training["end"], TRAIN, self.train_gen)

    def bucket_call_s(self, longest: int) -> tuple[float, float]:
        """(train step s, its serial part) of a batch whose longest sequence needs
        `longest` next-token positions, by ClusterSpec.train_bucket_s; the call's measured
        time less the publish stall, which the step pays after it."""
        buckets = self.cfg.cluster.train_bucket_s
        length, steady, first = next((b for b in buckets if b[0] >= longest), buckets[-1])
        first_use = length not in self.trained_buckets
        self.trained_buckets.add(length)
        call = first if first_use else steady
        return max(call - self.lay.publish_s, 0.0), call - steady

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
        self._count_generated()
        return summarize(self)
