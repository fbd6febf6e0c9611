"""Detect → Restart → Reconnect for the roles of a running job (RobustRL, seed 002):
the observing and acting halves; the deciding half is the pure fnrl.policy.faults.

Observe: what the controller has seen of each role since it (re)started (process exit,
a step that raised, training-phase progress, rollout token progress, heartbeats)
becomes `RoleHealth` values for `faults.decide_faults`. Act (called by the loop's `act`
on each decision):

- a rollout: it leaves routing at once (no KV room in the snapshot), its trajectories go
  back to the trajectory server with every streamed token kept in the partial response
  pool, its server is replaced, pulls the newest weights from its relay, and rejoins;
- the trainer: replaced (by its warm standby if it has one), restored from the newest
  Orbax checkpoint (saved every step, committed before a version is published) while
  rollouts keep generating; the batch it was training on is sent again (or accepted, if
  the step had been checkpointed);
- relays: the relay tier's monitor splices a dead relay out or elects a new master;
  its repairs are read here as events, recorded and counted as the relay's down time.
  A relay that exited is then replaced on its node (when the node is still there): the
  newcomer joins the chain, catches up, and its rollouts pull from it again. A hung or
  stopped relay is only spliced out (its process still holds its place on the node);
- `RestartJob`: raised as JobRestart to the job runner, which restarts every role from
  the checkpoint and the controller's journal.

It also injects faults (`--faults.inject.kills`) and keeps every outage, from which the
report computes the effective training time ratio (fnrl.control.report.ettr).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fnrl.control.book import Book, Services
from fnrl.control.handles import NodeLost, RoleError, Roles, ServerError
from fnrl.control.metrics import read_jsonl
from fnrl.policy import faults as F
from fnrl.shell.records import append, frame

HEARTBEAT_S = 1.0
# A relay's replacement is tried this many times, the waits between tries doubling from
# RELAY_BACKOFF_S (a port or segment the dead one held may take a moment to be freed).
RELAY_TRIES = 4
RELAY_BACKOFF_S = 1.0


class JobRestart(RuntimeError):
    """Escalation decided to restart the whole job from its checkpoint."""


@dataclass
class Watch:
    """What the controller has observed of one role since it (re)started."""

    busy_since_s: float | None = None
    last_progress_s: float = 0.0
    last_heartbeat_s: float = 0.0
    error: str | None = None
    restarting: bool = False
    steps_done: int = 0             # trainer: steps returned since it (re)started
    longest_step_s: float = 0.0


@dataclass
class Outage:
    role: str
    start_s: float          # the role stopped doing useful work (kill, or failed step start)
    detected_s: float
    ready_s: float | None = None
    reason: str = ""


class Supervisor:
    def __init__(self, cfg: F.FaultConfig, roles: Roles, *, book: Book, svc: Services,
                 run_dir: Path):
        self.cfg, self.roles, self.book, self.svc = cfg, roles, book, svc
        self.history = F.FaultHistory()
        self.watches: dict[str, Watch] = {}
        self.outages: list[Outage] = []
        self.injections = tuple(F.parse_injection(s) for s in cfg.inject.kills)
        F.check_injections(self.injections, roles.names())
        self.pending_kills: dict[str, float] = {}   # role -> when an injected fault landed
        self._rng = np.random.default_rng(cfg.inject.seed)
        self._relay_events_seen = 0
        self._restarts: set[asyncio.Task] = set()
        self._replacing: set[str] = set()   # relays whose replacement is under way
        self.failures = 0   # this attempt's failure records: every fault, relays' included
        # Set by the loop: what to do with a failed or restarted rollout / trainer.
        self.generation = self.training = None
        path = run_dir / "faults.jsonl"
        # An injection fires once per (role, step), also across controller and job restarts.
        self._injected = {(r["role"], r["step"]) for r in read_jsonl(path)
                          if r.get("event") == "inject_scheduled"}
        self._log = append(path)

    def start(self) -> None:
        """The loop starts: every role is in its first step (a fresh history)."""
        now = self.svc.now()
        names = ["trainer"] + [r.name for r in self.roles.rollouts]
        self.watches = {n: Watch(last_progress_s=now, last_heartbeat_s=now) for n in names}
        self.history = F.FaultHistory()
        self._relay_events_seen = 0
        self.svc.spawn(self._heartbeats())

    def record(self, event: str, **fields) -> None:
        self._log.write(frame({"t": self.svc.now(), "epoch": self.svc.clock.epoch(),
                               "event": event, **fields}))
        self.failures += event == "failure"
        self.svc.event(f"fault:{event}", **fields)

    def close(self) -> None:
        self._log.close()

    def down(self, role: str) -> bool:
        return any(o.role == role and o.ready_s is None for o in self.outages)

    # --- progress, reported by generation and training ----------------------------------

    def _progressed(self, role: str) -> None:
        self.watches[role].last_progress_s = self.svc.now()
        self.history = F.role_progressed(self.history, role)

    def streamed(self, rid: int) -> None:
        self.watches[self.roles.rollouts[rid].name].last_progress_s = self.svc.now()

    def finished(self, rid: int) -> None:
        self._progressed(self.roles.rollouts[rid].name)

    def failing(self, name: str) -> bool:
        return name in self.pending_kills or self.watches[name].restarting

    def train_started(self, step: int) -> None:
        self.watches["trainer"].busy_since_s = self.svc.now()
        for inj in self.injections:
            if F.injection_due(inj, step) and (inj.role, step) not in self._injected:
                self._injected.add((inj.role, step))   # once, even if the step is retried
                self._inject_later(inj, step)

    def train_returned(self) -> None:
        w = self.watches["trainer"]
        if w.busy_since_s is not None:
            took = self.svc.now() - w.busy_since_s
            # The first step compiles: it sizes the window only until a second returns.
            w.longest_step_s = took if w.steps_done <= 1 else max(w.longest_step_s, took)
            w.steps_done += 1
        w.busy_since_s = None
        self._progressed("trainer")

    def train_raised(self, err: Exception) -> None:
        """A training call failed. If the trainer's process still runs, the step raised:
        that is the failure (RobustRL wraps the step in try/catch); otherwise its exit
        is (or it was killed by a restart already under way)."""
        w = self.watches["trainer"]
        if self.roles.trainer.exit_code() is None and not w.restarting:
            w.error = str(err).splitlines()[-1][:500]

    # --- observe ------------------------------------------------------------------------

    def health(self, placed: np.ndarray) -> tuple[F.RoleHealth, ...]:
        now = self.svc.now()
        for r, n in enumerate(placed.tolist()):
            w = self.watches[self.roles.rollouts[r].name]
            if not n:
                w.busy_since_s = None
            elif w.busy_since_s is None:
                w.busy_since_s = now
        handles = {"trainer": self.roles.trainer, **{r.name: r for r in self.roles.rollouts}}
        return tuple(F.RoleHealth(
            name, "trainer" if name == "trainer" else "rollout",
            exit_code=None if w.restarting else handles[name].exit_code(),
            exit_reason=None if w.restarting else handles[name].exit_reason(), error=w.error,
            busy_since_s=w.busy_since_s, last_progress_s=w.last_progress_s,
            last_heartbeat_s=w.last_heartbeat_s, restarting=w.restarting,
            steps_done=w.steps_done, longest_step_s=w.longest_step_s)
            for name, w in self.watches.items())

    def relay_repairs(self) -> None:
        """Records the relay tier's chain repairs since the last look: each is a relay
        failure, and the relay is down from its failure until a replacement serves (for
        good when it cannot be replaced: a hung relay keeps its place on the node, a
        lost node has none). The trainer is not charged for a master's repair: a
        publish that waited on the election shows in its step's `time/publish_s`."""
        events = self.roles.relays.events()
        for e in events[self._relay_events_seen:]:
            start, ready = e.failed_at - self.svc.t0_epoch, e.repaired_at - self.svc.t0_epoch
            if not self.down(e.relay):   # killed again before its replacement served
                self.outages.append(Outage(e.relay, start, ready, reason=e.cause))
            self.record("failure", role=e.relay, reason=f"relay {e.cause}",
                        decision="SpliceRelay", step=self.book.trainer_version)
            self.record("chain_repaired", role=e.relay, cause=e.cause, repair_s=ready - start,
                        was_master=e.was_master, master=e.master)
            if e.cause == "exited" and e.relay not in self._replacing:
                self._replacing.add(e.relay)
                task = self.svc.spawn(self._replace_relay(e.relay))
                self._restarts.add(task)
                task.add_done_callback(self._restarts.discard)
        self._relay_events_seen = len(events)

    async def _replace_relay(self, name: str) -> None:
        """Replaces relay `name`, retried with backoff (RELAY_TRIES tries); every failed
        try is recorded. A relay never escalates to a job restart: while it is down the
        spliced chain's survivors serve its rollouts, and its outage stays open."""
        try:
            for attempt in range(RELAY_TRIES):
                try:
                    extra = await self.roles.relays.replace(name)
                    break
                except (RoleError, RuntimeError, OSError) as err:
                    final = isinstance(err, NodeLost) or attempt == RELAY_TRIES - 1
                    self.record("restart_failed", role=name, error=str(err)[:2000],
                                attempt=attempt + 1, final=final)
                    if final:
                        print(f"fnrl: relay {name} was not replaced: {err}", flush=True)
                        return
                    await self.svc.clock.sleep(RELAY_BACKOFF_S * 2 ** attempt)
        finally:
            self._replacing.discard(name)
        now = self.svc.now()
        outage = next(o for o in reversed(self.outages) if o.role == name)
        outage.ready_s = now
        self.record("recovered", role=name, down_s=now - outage.start_s,
                    since_detected_s=now - outage.detected_s, **extra)
        print(f"fnrl: relay {name} replaced at {extra.get('address')}, serving from "
              f"version {extra.get('version')} ({now - outage.start_s:.1f} s after it died)",
              flush=True)

    # --- act ------------------------------------------------------------------------------

    def act(self, decision: F.RestartRole | F.RestartJob) -> None:
        """Carries out one decision of `faults.decide_faults`."""
        now, role = self.svc.now(), decision.role
        start = self.pending_kills.pop(role, now)
        busy = self.watches["trainer"].busy_since_s
        if role == "trainer" and busy is not None:
            start = min(start, busy)   # the step in flight is lost
        self.record("failure", role=role, reason=decision.reason,
                    decision=type(decision).__name__, step=self.book.trainer_version)
        self.outages.append(Outage(role, start, now, reason=decision.reason))
        if isinstance(decision, F.RestartJob):
            raise JobRestart(decision.reason)
        w = self.watches[role]
        w.restarting, w.error, w.busy_since_s = True, None, None
        if role == "trainer":
            task = self.svc.spawn(self._restart(role, self._restart_trainer))
        else:
            rid = next(i for i, r in enumerate(self.roles.rollouts) if r.name == role)
            self.roles.rollouts[rid].kill()
            self.generation.rollout_down(rid)
            task = self.svc.spawn(self._restart(role, lambda: self._restart_rollout(rid)))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def settle(self) -> None:
        """Waits for the restarts under way (the run's steps are done), so the job ends
        with every role serving and each failure's recovery in faults.jsonl."""
        if self._restarts:
            await asyncio.wait(list(self._restarts))

    async def _restart(self, role: str, attempt) -> None:
        """Runs `attempt` until it succeeds; a failed restart is retried while the
        escalation rules allow (rule 3), then the job restarts."""
        while True:
            try:
                extra = await attempt()
                break
            except (RoleError, RuntimeError, ServerError, OSError, ValueError) as err:
                self.history = F.restart_failed(self.history, role)
                self.record("restart_failed", role=role, error=str(err)[:2000])
                if F.restart_gave_up(self.history, role, self.cfg):
                    raise JobRestart(f"{role} failed to restart: {err}") from err
        w, now = self.watches[role], self.svc.now()
        w.restarting = False
        w.last_progress_s = w.last_heartbeat_s = now
        w.steps_done = 0   # its next step compiles again
        self.history = F.role_started(self.history, role)
        outage = next(o for o in reversed(self.outages) if o.role == role and o.ready_s is None)
        outage.ready_s = now
        self.record("recovered", role=role, down_s=now - outage.start_s,
                    since_detected_s=now - outage.detected_s, **(extra or {}))
        self.svc.wake()

    async def _restart_trainer(self) -> dict:
        version = await self.roles.trainer.restart()
        self.training.restarted(version)
        return {"version": version}

    async def _restart_rollout(self, rid: int) -> dict:
        started_s = await self.roles.rollouts[rid].restart()
        await self.generation.rollout_up(rid)
        # Recovery = the server's own start time + moving its work + the weight pull.
        return {"server_start_s": started_s}

    async def _heartbeats(self) -> None:
        """Every second: each live rollout's /metrics (its heartbeat, and vLLM's
        waiting-queue length for the snapshot)."""
        async def beat(state) -> None:
            try:
                metrics = await asyncio.wait_for(state.handle.metrics(), 2 * HEARTBEAT_S)
            except (ServerError, asyncio.TimeoutError):
                return
            except RuntimeError as err:   # the job is ending: its HTTP session closed first
                if "Session is closed" not in str(err):
                    raise
                return
            state.waiting = int(metrics["vllm:num_requests_waiting"])
            self.watches[state.handle.name].last_heartbeat_s = self.svc.now()

        while True:
            await asyncio.gather(*(beat(s) for s in self.generation.rollouts if not s.down))
            await self.svc.clock.sleep(HEARTBEAT_S)

    # --- fault injection --------------------------------------------------------------------

    def _inject_later(self, inj: F.Injection, step: int) -> None:
        # A random point inside the phase: within the trainer's typical step for a
        # trainer kill, within a second of generation otherwise.
        typical = self.training.typical_step_s()
        delay = float(self._rng.uniform(0.1, 0.9)) * (typical if inj.phase == "train" else 1.0)
        self.record("inject_scheduled", role=inj.role, step=step, delay_s=delay)
        self.svc.spawn(self._inject(inj, step, delay))

    async def _inject(self, inj: F.Injection, step: int, delay: float) -> None:
        start = self.svc.now()
        while self.svc.now() - start < delay:
            # A train-phase kill lands inside its step: at the latest when the step returns
            # (the typical step may include a compile, and a late kill would land in a
            # later step, on top of that step's own injection).
            if inj.phase == "train" and self.book.steps_done >= step:
                break
            await self.svc.clock.sleep(0.01)
        if inj.role == "controller":
            self.record("inject", role="controller", step=step)
            self._log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        rollout = {r.name: i for i, r in enumerate(self.roles.rollouts)}.get(inj.role)
        if rollout is not None:
            # Mid-generation: wait until work is placed on it (however long that takes on
            # a busy machine; the run cannot end before, it needs this rollout's work).
            while not self.generation.table.on(rollout):
                await self.svc.clock.sleep(0.1)
        w = self.watches.get(inj.role)
        if w is not None and w.restarting:
            return
        # A relay's kill lands on a serving relay: one still being replaced waits for it.
        while inj.role in self.roles.relays.names and self.down(inj.role):
            await self.svc.clock.sleep(0.1)
        sig = signal.SIGSTOP if inj.signal == "stop" else signal.SIGKILL
        if inj.role in self.watches:   # relays are watched by their tier
            self.pending_kills[inj.role] = self.svc.now()
        self.record("inject", role=inj.role, step=step, signal=inj.signal)
        self.roles.kill(inj.role, sig)
