"""A simulated rollout instance: vLLM-style continuous batching over the decode cost model.

Trajectories are rows of `Trajectories` (columns, so the controller's snapshot is a
few numpy gathers). An `Instance` runs a batch of them: every decode step adds one
token to each running trajectory and takes L(kv, n) seconds (fnrl.sim.costs). Between
two events the batch is fixed, so the instance keeps an anchor (step count, time, KV)
and computes any later step's time in closed form; the next event is the earlier of
the next completion and the step at which the KV cache would overflow.

- Admission: first-come first-served from the waiting queue while the context fits the
  KV cache and the batch is under `max_num_seqs`; admitting a trajectory prefills its
  prompt plus the tokens it already has (a continued or preempted one re-prefills).
- Preemption: when the next step would not fit, the newest running trajectory goes back
  to the front of the queue, its KV freed (vLLM's recompute preemption).
- Prefix cache: a trajectory that left (interrupted, migrated, preempted) and comes back
  to the same engine re-prefills only what was evicted: its blocks stay cached until
  later allocations have used up the free space it left (LRU), and a weight load resets
  the cache (fnrl's servers call /reset_prefix_cache after every pull).
- Pull: the engine stops generating until the new weights are loaded.
- Commands cost engine time (`costs.CommandCosts`, when the table has [commands]): a
  request that leaves (interrupt, migration's source, abort, preemption by a pull)
  leaves the step in flight to finish with the batch it started with, its token in it
  thrown away, and its removal (`abort_s`) delays the next step; an admission costs
  its request (`admit_s`, unless the profile has `per_request_s`), the lookup of its
  context's blocks, and a prefill of all but the cache's whole blocks (at least its
  last token); a request reaching an idle engine starts one cycle's decide and one
  RPC after the cycle (`not_before`).
- Tool calls (multi-turn workloads, `WorkloadSpec.turns` > 1): at the end of each turn
  but the last the trajectory leaves the batch for its call (state TOOL, still placed
  here). It keeps its KV blocks (counted against capacity, not in the step's KV term)
  or releases them (the prefix cache may keep them); when the call returns it goes to
  the front of the queue, its context grown by the tool's observation, and admission
  prefills what is not held or cached. A weight load drops held blocks.

Gaps (ours): KV is counted in tokens (a sequence's partly filled last block is
ignored: under 16 tokens of a multi-thousand-token context); a step in progress when the
batch changes finishes with the new batch (membership changes at step boundaries).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque

import numpy as np

from fnrl.sim import costs
from fnrl.sim.costs import CommandCosts, DecodeCosts
from fnrl.sim.workload import turn_ends

IN_TS, QUEUED, RUNNING, GONE, TOOL = 0, 1, 2, 3, 4   # Trajectories.state
CLOCK_RESOLUTION_S = 1e-9
"""Times this close are simultaneous (asyncio runs every timer due within its clock's
resolution in one iteration; the real loop, tests/sim/test_real_loop.py, does)."""


class Trajectories:
    """Every trajectory of the run, by tid (dense, in arrival order)."""

    def __init__(self, capacity: int = 1024):
        self.n = 0
        self.gid = np.zeros(capacity, np.int64)
        self.prompt = np.zeros(capacity, np.int64)
        self.target = np.zeros(capacity, np.int64)     # response tokens it will generate
        self.gen = np.zeros(capacity, np.int64)        # generated, as of its last settle
        self.join_step = np.zeros(capacity, np.int64)  # its instance's step when it started
        self.fin_step = np.zeros(capacity, np.int64)   # ... and when it will finish
        self.inst = np.full(capacity, -1, np.int64)    # -1: in the TS (or gone)
        self.state = np.zeros(capacity, np.int8)
        self.turns = np.ones(capacity, np.int64)       # decode turns (tool calls between)
        self.tool_until = np.zeros(capacity)           # when its last tool call returns
        self.routed_s = np.full(capacity, -1.0)        # when first routed (-1: not yet)
        self.done_s = np.full(capacity, -1.0)          # when it finished (-1: not yet)
        self.segments: list[list[tuple[int, int]]] = []   # (version, tokens) per placement

    def add(self, gid: int, prompt: int, targets: np.ndarray, turns: int = 1) -> range:
        k = len(targets)
        if self.n + k > len(self.gid):
            grow = max(len(self.gid), k)
            for name in ("gid", "prompt", "target", "gen", "join_step", "fin_step", "inst", "state",
                         "turns", "tool_until", "routed_s", "done_s"):
                a = getattr(self, name)
                fill = -1 if name in ("inst", "routed_s", "done_s") else 0
                setattr(self, name, np.concatenate([a, np.full(grow, fill, a.dtype)]))
        tids = range(self.n, self.n + k)
        self.gid[tids.start:tids.stop] = gid
        self.prompt[tids.start:tids.stop] = prompt
        self.target[tids.start:tids.stop] = targets
        self.turns[tids.start:tids.stop] = turns
        self.segments.extend([] for _ in tids)
        self.n += k
        return tids

    def latencies(self) -> np.ndarray:
        """Seconds from first being routed to finishing, of every finished trajectory
        (Laminar Table 1's "latency of generating trajectories"): time queued in an
        engine, interrupted, migrated or at a tool counts; time waiting to be routed
        does not."""
        done = self.done_s[:self.n] >= 0
        return self.done_s[:self.n][done] - self.routed_s[:self.n][done]

    def context(self, tid: int) -> int:
        return int(self.prompt[tid] + self.gen[tid])

    def stop(self, tid: int) -> int:
        """Generated tokens at which its current turn ends (its target when single-turn)."""
        target = int(self.target[tid])
        if self.turns[tid] <= 1:
            return target
        gen = int(self.gen[tid])
        return next(e for e in turn_ends(target, int(self.turns[tid])) if e > gen)


class Instance:
    """One rollout engine (a TP group of GPUs)."""

    def __init__(self, rid: int, decode: DecodeCosts, trajs: Trajectories, *, kv_capacity: int,
                 max_num_seqs: int, version: int = 0, hold_kv: bool = True,
                 commands: CommandCosts | None = None):
        self.rid, self.trajs = rid, trajs
        self.decode = decode
        self.cost = decode.cost
        self.commands = commands                 # None: commands cost the engine nothing
        self.per_request_s = decode.per_request_s or (commands.admit_s if commands else 0.0)
        self.prefill_s, self.request_s = decode.prefill_s_per_token, self.per_request_s
        self.slowdown = 1.0
        self.not_before = 0.0                    # the newest request sent here lands then
        self.command_s = 0.0                     # engine seconds its commands took
        self.cap, self.max_num_seqs, self.version = float(kv_capacity), max_num_seqs, version
        self.step, self.t, self.n, self.kv = 0, 0.0, 0, 0.0
        self.running: dict[int, int] = {}       # tid -> finish step, in admission order
        self.queue: deque[int] = deque()
        self._fin: list[tuple[int, int]] = []   # (finish step, tid), stale entries skipped
        self.pulling = False
        self.pending_step: int | None = None     # the step of the scheduled event
        self._step_end = 0.0                     # when the step in progress ends
        self.gen = 0                             # bumps invalidate scheduled events
        self.complete = 0                        # finished here since its last Pull
        # Accounting, with the attribute names fnrl.control.report reads.
        self.kv_capacity = self.cap
        self.active_s = self.kv_token_s = self.blocked_s = 0.0
        self.busy_s = 0.0                        # decoding or prefilling
        self.prefill_tokens = self.preemptions = self.cache_hit_tokens = 0
        self.alloc = 0                           # KV tokens ever allocated here (LRU clock)
        self._cached: dict[int, tuple[int, int, float]] = {}   # tid -> (tokens, alloc, free)
        self.hold_kv = hold_kv                   # tool calls keep their KV blocks
        self.held: dict[int, int] = {}           # tid -> KV tokens it holds while not running
        self.held_kv = 0.0
        self.tool_calls: list[int] = []          # turns ended since the caller last drained it

    # --- time -----------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Moves the anchor to the last step boundary at or before `now`, and before
        the scheduled event's step whatever the rounding."""
        if self.pulling:
            return
        if self.n == 0:
            self.t = max(self.t, now)
            return
        m = costs.steps_within(self.cost, self.kv, self.n, now - self.t + CLOCK_RESOLUTION_S)
        if self.pending_step is not None:
            m = min(m, max(self.pending_step - self.step - 1, 0))
        self._take(m)
        # When the step now running ends (with the batch it started with): if every
        # trajectory leaves during it, the engine still finishes it (the GPU work is in
        # flight), and newcomers start after it. A batch not started yet (t in the
        # future: prefill, or a step finishing) has no step of its own running.
        self._step_end = self.t + costs.step_s(self.cost, self.kv, self.n) if self.t <= now \
            else self.t

    @property
    def step_end(self) -> float:
        """When the step in flight ends (after `advance`; its anchor when none runs)."""
        return self._step_end if self.n else self.t

    def set_slowdown(self, f: float) -> None:
        """Every decode step and prefill takes f times its cost from here on (cores shared
        with other roles). Call after `advance`; the caller reschedules the next event."""
        c, d = self.decode.cost, self.decode
        self.cost = dataclasses.replace(c, k1=c.k1 * f, k2=c.k2 * f, k3=c.k3 * f, k4=c.k4 * f)
        self.prefill_s, self.request_s = d.prefill_s_per_token * f, self.per_request_s * f
        self.slowdown = f

    def _take(self, m: int) -> None:
        dt = costs.decode_steps_s(self.cost, self.kv, self.n, m)
        self.t += dt
        self.busy_s += dt
        self.step += m
        self.kv += self.n * m
        self.alloc += self.n * m

    def next_event(self) -> tuple[float, int] | None:
        """(time, step) of the next completion or KV overflow, or None when idle."""
        self.pending_step = None
        if self.pulling or self.n == 0:
            return None
        fin = self._fin
        while fin and not self._valid(*fin[0]):
            heapq.heappop(fin)
        m_fin = fin[0][0] - self.step
        m_kv = int((self.cap - self.held_kv - self.kv) // self.n)   # steps before it overflows
        m = max(min(m_fin, m_kv), 0)
        self.pending_step = self.step + m
        return self.t + costs.decode_steps_s(self.cost, self.kv, self.n, m), self.step + m

    def on_event(self, t: float, step: int) -> list[int]:
        """The scheduled event at `step` happened at time t: returns the tids that finished."""
        self._take(step - self.step)
        self.t = self._step_end = t   # exact, not re-summed; no step in progress yet
        done = []
        fin, trajs = self._fin, self.trajs
        while fin and fin[0][0] <= self.step:
            s, tid = heapq.heappop(fin)
            if self._valid(s, tid):
                self._leave(tid)
                if trajs.gen[tid] < trajs.target[tid]:   # a turn ended: its tool call
                    self._call_tool(tid)
                    continue
                trajs.state[tid], trajs.inst[tid] = GONE, -1
                self.complete += 1
                done.append(tid)
        while self.n > 0 and self.kv + self.n > self.cap - self.held_kv:
            victim = next(reversed(self.running))
            self._leave(victim)
            trajs.state[victim] = QUEUED
            self.queue.appendleft(victim)
            self.preemptions += 1
        return done

    # --- membership -----------------------------------------------------------------------

    def _valid(self, s: int, tid: int) -> bool:
        return self.running.get(tid) == s

    def _leave(self, tid: int) -> None:
        """A running trajectory stops here: its tokens are settled into a segment."""
        tr = self.trajs
        made = self.step - int(tr.join_step[tid])
        if made > 0:
            tr.gen[tid] += made
            tr.segments[tid].append((self.version, made))
        # Joined during the step still in progress: one token fewer was counted (admit).
        self.kv -= tr.context(tid) - (made < 0)
        self.n -= 1
        del self.running[tid]
        if tr.state[tid] == RUNNING and tr.gen[tid] < tr.target[tid]:
            self._cached[tid] = (tr.context(tid), self.alloc, self.cap - self.kv)

    def _call_tool(self, tid: int) -> None:
        self.trajs.state[tid] = TOOL
        if self.hold_kv:
            self._cached.pop(tid, None)
            self.held[tid] = self.trajs.context(tid)
            self.held_kv += self.held[tid]
        self.tool_calls.append(tid)

    def _release(self, tid: int) -> None:
        self.held_kv -= self.held.pop(tid, 0)

    def enqueue(self, tid: int) -> None:
        self.trajs.inst[tid], self.trajs.state[tid] = self.rid, QUEUED
        self.queue.append(tid)

    def await_tool(self, tid: int) -> None:
        """Placed here while its tool call is still out: it queues when the call returns."""
        self.trajs.inst[tid], self.trajs.state[tid] = self.rid, TOOL

    def tool_returned(self, tid: int) -> None:
        """Its call returned (the observation already in its context): it resumes first."""
        self.trajs.state[tid] = QUEUED
        self.queue.appendleft(tid)

    def remove(self, tid: int) -> None:
        """Interrupt / migrate / abort: the trajectory leaves, its tokens kept."""
        state = self.trajs.state[tid]
        if state == RUNNING:
            self._leave(tid)
        elif state == QUEUED:
            self.queue.remove(tid)
        self._release(tid)
        self.trajs.inst[tid], self.trajs.state[tid] = -1, IN_TS

    def released(self, k: int) -> None:
        """k requests just left (`remove`, after `advance`): with command costs, the step
        in flight ends when it would have with them in it (the GPU work was issued;
        their tokens in it are thrown away), and dropping them delays the next step."""
        if self.commands is None or k == 0:
            return
        drop = self.commands.abort_s * k * self.slowdown
        if self.n > 0:
            start = max(self.t, self._step_end - costs.step_s(self.cost, self.kv, self.n))
            self.command_s += start - self.t + drop
            self.busy_s += start - self.t + drop
            self.t = start + drop
        else:
            self._step_end = max(self._step_end, self.t) + drop
            self.command_s += drop
            self.busy_s += drop

    def admit(self, now: float) -> int:
        """Starts queued trajectories that fit (FCFS); returns the tokens prefilled."""
        if self.pulling:
            return 0
        tr, prefill = self.trajs, 0
        if self.n == 0:
            # An idle engine starts on a request once it has arrived (a busy one takes
            # it at its next step's boundary, which the arrival mostly precedes).
            self.t = max(self.t, now, self._step_end, self.not_before if self.queue else 0.0)
        # A step is in progress: newcomers join the batch at its end (vLLM schedules a
        # step's batch before running it). Their KV is counted one token short, which
        # the step's growth (n tokens, them included) makes up.
        late = 1 if self.t < now - CLOCK_RESOLUTION_S else 0
        while self.queue and self.n < self.max_num_seqs:
            tid = self.queue[0]
            ctx = tr.context(tid)
            held = self.held.get(tid, 0)
            # Room for its context and for one more step of the whole batch, so an
            # admission never preempts at once.
            if self.kv + ctx + self.n + 1 > self.cap - (self.held_kv - held):
                break
            self.queue.popleft()
            tr.state[tid], tr.join_step[tid] = RUNNING, self.step + late
            fin = self.step + late + tr.stop(tid) - int(tr.gen[tid])
            tr.fin_step[tid] = fin
            heapq.heappush(self._fin, (fin, tid))
            self.running[tid] = fin
            self.n += 1
            self.kv += ctx - late
            hit = held
            self._release(tid)
            if tid in self._cached:
                tokens, alloc, free = self._cached.pop(tid)
                hit = min(tokens, ctx) if self.alloc - alloc <= free else 0
                if self.commands is not None:
                    hit = ctx - costs.cached_prefill_tokens(ctx, hit, self.commands.block_tokens)
            self.cache_hit_tokens += hit
            self.alloc += ctx - hit
            prefill += ctx - hit
            dt = self.prefill_s * (ctx - hit) + self.request_s
            if self.commands is not None:
                c = self.commands
                lookup = c.lookup_s_per_block * -(-ctx // c.block_tokens) * self.slowdown
                dt += lookup
                self.command_s += lookup + self.request_s
            self.t += dt
            self.busy_s += dt
        self.prefill_tokens += prefill
        return prefill

    def begin_pull(self) -> None:
        """Generation stops; anything still running waits at the front of the queue."""
        for tid in reversed(list(self.running)):
            self._leave(tid)
            self.trajs.state[tid] = QUEUED
            self.queue.appendleft(tid)
        self.pulling = True
        self._cached.clear()
        self.held.clear()   # blocks of the old weights: a held call re-prefills
        self.held_kv = 0.0

    def end_pull(self, now: float, version: int) -> None:
        self.pulling, self.version, self.t = False, version, now
