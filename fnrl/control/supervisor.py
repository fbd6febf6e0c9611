"""Detect → Restart → Reconnect for the roles of a running job (RobustRL, seed 002).

The controller calls `Supervisor.tick()` once per loop iteration. It freezes what it
has observed of each role (process exit, reported exception, training-phase progress,
rollout token progress, heartbeats) into `RoleHealth` values, asks the pure
`fnrl.policy.faults.detect` / `escalate` what failed and what to do, and acts:

- a rollout: it leaves routing at once (no KV room in the snapshot), its trajectories
  go back to the trajectory server with every streamed token kept in the partial
  response pool (the cycle routes them to live rollouts the staleness bound allows),
  its server is killed and started again, pulls the newest weights from its relay,
  and rejoins;
- the trainer: its process is killed and started again; it restores the newest Orbax
  checkpoint (saved every step, committed before a version is published, so the
  versions rollouts see never go back) while rollouts keep generating, and the batch it
  was training on is sent again (or accepted, if the step had been checkpointed);
- relays: the relay tier's monitor splices a dead relay out of the chain or elects a
  new master; the trainer's publisher follows the master, and rollouts pull from the
  live relay nearest to them;
- `RestartJob`: raised to the job runner, which restarts every role from the checkpoint
  and the controller's journal.

It also injects faults (`--faults.inject`) and keeps each role's down time, from which
the effective training time ratio is computed (RobustRL §5.1: each time slice weighted
by the share of roles doing useful work; roles are the trainer and the rollouts).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fnrl.control import wire
from fnrl.policy import faults as F
from fnrl.serving.client import RolloutClient, ServerError
from fnrl.serving.server import wait_ready

if TYPE_CHECKING:
    from fnrl.control.loop import Controller

HEARTBEAT_S = 1.0


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


@dataclass
class Outage:
    role: str
    start_s: float          # the role stopped doing useful work (kill, or failed step start)
    detected_s: float
    ready_s: float | None = None
    reason: str = ""


@dataclass
class Supervisor:
    ctl: "Controller"
    cfg: F.FaultConfig
    history: F.FaultHistory = field(default_factory=F.FaultHistory)
    watches: dict[str, Watch] = field(default_factory=dict)
    outages: list[Outage] = field(default_factory=list)
    injections: tuple[F.Injection, ...] = ()
    pending_kills: dict[str, float] = field(default_factory=dict)   # role -> injected kill time
    standby: wire.RoleClient | None = None    # a spare trainer (warming up, or ready)
    standby_ready: bool = False
    _warming: bool = False
    _rng: np.random.Generator | None = None
    _injected: set = field(default_factory=set)
    _log = None

    def __post_init__(self):
        self.injections = tuple(F.parse_injection(s) for s in self.cfg.inject)
        self._rng = np.random.default_rng(self.cfg.seed)
        path = self.ctl.run_dir / "faults.jsonl"
        # An injection fires once per (role, step), also across controller and job restarts.
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r.get("event") == "inject_scheduled":
                    self._injected.add((r["role"], r["step"]))
        self._log = open(path, "a", buffering=1)

    # --- time and bookkeeping ---------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.ctl._t0

    def start(self, step: int) -> None:
        """The loop starts: every role is in its first step (a fresh history)."""
        now = self.now()
        names = ["trainer"] + [f"rollout{r}" for r in range(len(self.ctl.rollouts))]
        self.watches = {name: Watch(last_progress_s=now, last_heartbeat_s=now) for name in names}
        self.history = F.FaultHistory()
        if self.cfg.trainer_standby:
            self.ctl._spawn(self.start_standby())

    def record(self, event: str, **fields) -> None:
        self._log.write(json.dumps({"t": self.now(), "event": event, **fields}) + "\n")
        self.ctl.timeline.append({"t": self.now(), "event": f"fault:{event}", **fields})

    def close(self) -> None:
        self._log.close()

    def progressed(self, role: str) -> None:
        w = self.watches.get(role)
        if w is not None:
            w.last_progress_s = self.now()
        self.history = F.role_progressed(self.history, role)

    # --- the trainer's phase, reported by the loop ------------------------------------

    def train_started(self, step: int) -> None:
        w = self.watches["trainer"]
        w.busy_since_s = self.now()
        for inj in self.injections:
            if F.injection_due(inj, step) and (inj.role, step) not in self._injected:
                self._injected.add((inj.role, step))   # once, even if the step is retried
                self._inject_later(inj, step)

    def train_returned(self) -> None:
        w = self.watches["trainer"]
        w.busy_since_s = None
        self.progressed("trainer")

    def trainer_raised(self, err: Exception, client: wire.RoleClient) -> None:
        """A training call on `client` failed. If its process still runs, the step raised:
        that is the failure (RobustRL wraps the step in try/catch); otherwise its exit is
        (or it was killed by a restart already under way)."""
        if client.proc.poll() is None and client is self.ctl.trainer:
            self.watches["trainer"].error = str(err).splitlines()[-1][:500]

    # --- the tick -------------------------------------------------------------------

    def health(self) -> tuple[F.RoleHealth, ...]:
        out = []
        for name, w in self.watches.items():
            role = self.ctl.cluster.role(name)
            code = None if w.restarting else role.proc.poll()
            kind = "trainer" if name == "trainer" else "rollout"
            out.append(F.RoleHealth(name, kind, exit_code=code, error=w.error,
                                    busy_since_s=w.busy_since_s, last_progress_s=w.last_progress_s,
                                    last_heartbeat_s=w.last_heartbeat_s, restarting=w.restarting))
        return tuple(out)

    def tick(self, placed: np.ndarray) -> None:
        now = self.now()
        for r, n in enumerate(placed.tolist()):
            w = self.watches[f"rollout{r}"]
            if n and w.busy_since_s is None:
                w.busy_since_s = now
            elif not n:
                w.busy_since_s = None
        for failure in F.detect(now, self.health(), self.cfg):
            self.history, decision = F.escalate(self.history, failure,
                                                step=self.ctl.book.trainer_version, cfg=self.cfg)
            start = self.pending_kills.pop(failure.role, now)
            if failure.role == "trainer" and self.watches["trainer"].busy_since_s is not None:
                start = min(start, self.watches["trainer"].busy_since_s)   # the step is lost
            self.record("failure", role=failure.role, reason=failure.reason,
                        decision=type(decision).__name__, step=self.ctl.book.trainer_version)
            if isinstance(decision, F.RestartJob):
                self.outages.append(Outage(failure.role, start, now, reason=failure.reason))
                raise JobRestart(decision.reason)
            self.outages.append(Outage(failure.role, start, now, reason=failure.reason))
            self._restart(failure.role)

    # --- restarts -------------------------------------------------------------------

    def _restart(self, role: str) -> None:
        w = self.watches[role]
        w.restarting, w.error, w.busy_since_s = True, None, None
        self.ctl.cluster.kill(role)
        if role == "trainer":
            self.ctl._spawn(self._restart_trainer())
        else:
            rid = int(role.removeprefix("rollout"))
            self.ctl.rollout_failed(rid)
            self.ctl._spawn(self._restart_rollout(rid))

    def _ready(self, role: str, **extra) -> None:
        w = self.watches[role]
        now = self.now()
        w.restarting = False
        w.last_progress_s = w.last_heartbeat_s = now
        self.history = F.role_started(self.history, role)
        outage = next(o for o in reversed(self.outages) if o.role == role and o.ready_s is None)
        outage.ready_s = now
        self.record("recovered", role=role, down_s=now - outage.start_s,
                    since_detected_s=now - outage.detected_s, **extra)
        self.ctl.wake.set()

    async def _retry(self, role: str, attempt) -> bool:
        """Runs `attempt` until it succeeds; a failed restart is retried once (rule 3)."""
        while True:
            try:
                await attempt()
                return True
            except (wire.RoleError, RuntimeError, ServerError, OSError) as err:
                self.history = F.restart_failed(self.history, role)
                self.record("restart_failed", role=role, error=str(err)[:2000])
                if F.restart_gave_up(self.history, role, self.cfg):
                    raise JobRestart(f"{role} failed to restart: {err}") from err
                self.ctl.cluster.kill(role)

    async def _restart_trainer(self) -> None:
        ctl = self.ctl

        async def attempt():
            # A spare still warming up is taken too: it is ahead of a process started now.
            standby, ready = self.standby, self.standby_ready
            self.standby, self.standby_ready = None, False
            if standby is not None and standby.proc.poll() is None:
                role = ctl.cluster.promote("trainer_standby", "trainer")
                client = wire.RoleClient("trainer", role.address, role.proc, str(role.log_path))
                if ready:   # (a socket still waiting for its reply is left to its thread)
                    standby.close()
                cmd = {"cmd": "takeover"}
            else:
                role = ctl.cluster.restart_trainer()
                client = wire.RoleClient("trainer", role.address, role.proc, str(role.log_path))
                cmd = {"cmd": "init"}
            init = await asyncio.to_thread(client.call, cmd, timeout_s=ctl.cfg.trainer_timeout_s)
            ctl.trainer = client
            ctl.trainer_restarted(init["version"])
            self.record("trainer_started", how=cmd["cmd"], version=init["version"])

        await self._retry("trainer", attempt)
        self._ready("trainer")
        if self.cfg.trainer_standby:
            ctl._spawn(self.start_standby())

    async def warm_standby(self) -> None:
        """The trainer saw a new batch shape: the spare compiles it too."""
        standby = self.standby
        if standby is None or not self.standby_ready or self._warming:
            return
        self._warming = True
        try:
            await asyncio.to_thread(standby.call, {"cmd": "warm"},
                                    timeout_s=self.ctl.cfg.trainer_timeout_s)
        except wire.RoleError:
            pass   # it is checked for life at takeover
        finally:
            self._warming = False

    async def start_standby(self) -> None:
        """Starts a warm spare trainer in the background (RobustRL's warm standby)."""
        role = self.ctl.cluster.restart_trainer(name="trainer_standby")
        client = wire.RoleClient("trainer_standby", role.address, role.proc, str(role.log_path))
        self.standby, self.standby_ready = client, False
        try:
            reply = await asyncio.to_thread(client.call, {"cmd": "standby"},
                                            timeout_s=self.ctl.cfg.trainer_timeout_s)
        except wire.RoleError as err:
            if self.standby is client:   # no spare: a failure restarts from scratch
                self.standby = None
                self.record("standby_failed", error=str(err)[:2000])
            return
        if self.standby is client:      # not taken over while it warmed up
            self.standby_ready = True
            self.record("standby_ready", warmed_shapes=reply["warmed"])

    async def _restart_rollout(self, rid: int) -> None:
        ctl = self.ctl
        state = ctl.rollouts[rid]

        started = {}

        async def attempt():
            role = ctl.cluster.restart_server(rid)
            started["s"] = await asyncio.to_thread(wait_ready, role.address, role.proc,
                                                   ctl.cfg.rollout.start_timeout_s)
            old = state.client
            state.client = RolloutClient(role.address, old.session, timeout_s=old.timeout_s)
            state.version = await state.client.pull(ctl.relay_for(rid),
                                                    min_version=ctl.book.trainer_version)

        await self._retry(f"rollout{rid}", attempt)
        state.down = False
        # Recovery = the server's own start time + moving its work + the weight pull.
        self._ready(f"rollout{rid}", server_start_s=started["s"])

    # --- heartbeats -------------------------------------------------------------------

    async def heartbeats(self) -> None:
        """Every second: each live rollout's /metrics (its heartbeat, and vLLM's
        waiting-queue length for the snapshot)."""
        async def beat(rid: int, state) -> None:
            try:
                metrics = await asyncio.wait_for(state.client.metrics(), 2 * HEARTBEAT_S)
            except (ServerError, asyncio.TimeoutError):
                return
            state.waiting = int(metrics["vllm:num_requests_waiting"])
            self.watches[f"rollout{rid}"].last_heartbeat_s = self.now()

        while True:
            await asyncio.gather(*(beat(r, s) for r, s in enumerate(self.ctl.rollouts)
                                   if not s.down))
            await asyncio.sleep(HEARTBEAT_S)

    # --- fault injection ----------------------------------------------------------------

    def _inject_later(self, inj: F.Injection, step: int) -> None:
        # A random point inside the phase: within the trainer's typical step for a
        # trainer kill, within a second of generation otherwise.
        typical = self.ctl.typical_step_s()
        delay = float(self._rng.uniform(0.1, 0.9)) * (typical if inj.phase == "train" else 1.0)
        self.record("inject_scheduled", role=inj.role, step=step, delay_s=delay)
        self.ctl._spawn(self._inject(inj, step, delay))

    async def _inject(self, inj: F.Injection, step: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if inj.role == "controller":
            self.record("inject", role="controller", step=step)
            self._log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if inj.role.startswith("rollout"):
            # Mid-generation: wait (a little) for work to be placed on it.
            rid = int(inj.role.removeprefix("rollout"))
            for _ in range(50):
                if self.ctl.table.on(rid):
                    break
                await asyncio.sleep(0.1)
        w = self.watches.get(inj.role)
        if w is not None and w.restarting:
            return
        if inj.signal == "stop":   # a hang: the process lives on, silent
            self.pending_kills[inj.role] = self.now()
            self.record("inject", role=inj.role, step=step, signal="stop")
            self.ctl.cluster.kill(inj.role, sig=signal.SIGSTOP, wait=False)
            return
        if inj.role.startswith("relay"):
            self.ctl.cluster.kill(inj.role, wait=False)
            self.record("inject", role=inj.role, step=step)
            await self._time_chain_repair(inj.role)
            return
        self.pending_kills[inj.role] = self.now()
        self.record("inject", role=inj.role, step=step)
        self.ctl.cluster.kill(inj.role, wait=False)

    async def _time_chain_repair(self, relay: str) -> None:
        """Records how long the relay tier took to splice a killed relay out of the chain
        and tell the survivors their new places (or elect a new master)."""
        tier = self.ctl.cluster.relay_tier
        if tier is None:
            return
        t0 = time.perf_counter()
        while relay in tier.plan.order or tier.configured_epoch < tier.plan.epoch:
            if time.perf_counter() - t0 > 60:
                return
            await asyncio.sleep(0.005)
        self.record("chain_repaired", role=relay, repair_s=time.perf_counter() - t0,
                    chain=list(tier.plan.order), master=tier.plan.order[0] if tier.plan.order else None)

    # --- effective training time ratio ------------------------------------------------

    def ettr(self, wall_s: float) -> dict:
        """1 − (role-seconds down) / (role-seconds in all), over the trainer and rollouts."""
        units = 1 + len(self.ctl.rollouts)
        down = sum((o.ready_s if o.ready_s is not None else wall_s) - o.start_s
                   for o in self.outages)
        recov = [o.ready_s - o.detected_s for o in self.outages if o.ready_s is not None]
        by_role: dict[str, list[float]] = {}
        for o in self.outages:
            if o.ready_s is not None:
                kind = "trainer" if o.role == "trainer" else "rollout"
                by_role.setdefault(kind, []).append(o.ready_s - o.start_s)
        return {"ettr": 1.0 - down / max(units * wall_s, 1e-9), "failures": len(self.outages),
                "role_down_s": down, "ettr_units": units, "loop_start": self.ctl._t0_epoch,
                **{f"{k}_recovery_s_mean": float(np.mean(v)) for k, v in by_role.items()},
                **{f"{k}_recovery_s_max": float(np.max(v)) for k, v in by_role.items()},
                "recovery_after_detect_s_max": max(recov, default=0.0)}
