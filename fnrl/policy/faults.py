"""Role-based fault handling (RobustRL, seed 002): Detect, then decide what to restart.

Two pure functions over immutable values; the controller loop owns the clock and the
processes and feeds them observations:

- `detect(now_s, roles, cfg)` finds failed roles, phase-aware (§2.2-2.3):
  * any role whose process exited, or that reported an exception, has failed;
  * the trainer has failed when it makes no progress during its training phase for
    `trainer_hang_s` (the paper: zero TensorCore activity for 5 minutes, only while
    training). Waiting for rollouts is not the training phase, so it never counts;
  * a rollout is suspect after `rollout_stall_s` of zero throughput while it has work
    placed on it (60 s in the paper), and has failed only if its heartbeat is also
    missing for `heartbeat_timeout_s`: a rollout slowly decoding a long tail keeps
    answering its heartbeat and is left alone.
  Relays are watched by the relay tier's own monitor (fnrl.relay.tier: heartbeats,
  splice, master re-election), which repairs the chain without a restart decision.

- `escalate(history, failure, cfg)` applies the escalation rules (§2.4, Fig. 7) and
  returns the next history and a decision: restart the role alone, or the whole job
  from its checkpoint, which is the paper's answer to a failure that a role restart
  would only repeat:
  1. a failure in the first step after the role (or the job) started: an explicit
     machine or code error;
  2. a second failure of the same role in the same step: a reproducible fault;
  3. more than `max_restart_failures` failed restarts of a role (`restart_failed`, then
     `restart_gave_up`).
  Under `policy="job"` every failure restarts the job: the ByteRobust-style baseline
  that `benchmarks/ettr.py` measures fnrl against.

Gaps the paper leaves, and what we chose:
- "Step" is the trainer's version when the failure is seen; for a rollout, the first
  step after its start means it has not finished a trajectory since it (re)started.
- The heartbeat period and timeout are not given (digest §2.3); we default to a 10 s
  timeout, heartbeats being sent every second by the controller.
- Rule 2 is keyed by role: two different rollouts dying in one step are two
  independent faults, not a reproducible one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

RoleKind = Literal["trainer", "rollout"]


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """How failures are detected and answered (`--faults.*`)."""

    policy: Literal["role", "job"] = "role"
    """"role": restart only the failed role (RobustRL); "job": restart every role from
    the checkpoint on any failure (the whole-job baseline)."""
    trainer_hang_s: float = 300.0
    """No progress for this long while a training step runs: the trainer has failed."""
    rollout_stall_s: float = 60.0
    """Zero throughput for this long while work is placed on a rollout: suspect."""
    heartbeat_timeout_s: float = 10.0
    """A suspect rollout whose heartbeat has not answered for this long has failed."""
    max_restart_failures: int = 1
    """Failed restarts of one role that are retried before the job restarts (paper: 1)."""
    max_job_restarts: int = 3
    """Whole-job restarts before the run gives up with the last failure's error."""
    trainer_standby: bool = False
    """Keep a warm spare trainer (built, compiled, waiting) that takes over a failed
    trainer by restoring the newest checkpoint: RobustRL's warm standby (§3.2, a borrowed
    rollout machine), at the cost of a second trainer's memory."""
    inject: tuple[str, ...] = ()
    """Fault injection, each `ROLE:every=N[:at=K][:phase=train|generate][:signal=kill|stop]`:
    SIGKILL (or SIGSTOP: a hang, which only detection windows find) the role (trainer,
    rollout<i>, relay<i>, controller) at step K, K+N, ... (K defaults to N) during the
    given phase (default: train for the trainer, generate otherwise)."""
    seed: int = 0
    """Seed of the delay into the phase at which an injected kill lands."""

    def __post_init__(self):
        object.__setattr__(self, "inject", tuple(self.inject))   # a JSON list reads back
        for name in ("trainer_hang_s", "rollout_stall_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FaultConfig.{name}={getattr(self, name)!r}: must be > 0")
        if self.policy not in ("role", "job"):
            raise ValueError(f"FaultConfig.policy={self.policy!r}: must be 'role' or 'job'")
        for name in ("max_restart_failures", "max_job_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"FaultConfig.{name}={getattr(self, name)!r}: must be >= 0")
        for spec in self.inject:
            parse_injection(spec)


@dataclass(frozen=True)
class Injection:
    role: str
    every: int
    at: int
    phase: Literal["train", "generate"]
    signal: Literal["kill", "stop"] = "kill"


def parse_injection(spec: str) -> Injection:
    """`trainer:every=10` → Injection("trainer", 10, 10, "train"); errors name the spec."""
    role, *opts = spec.split(":")
    fields: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("every", "at", "phase", "signal"):
            raise ValueError(f"fault injection {spec!r}: expected "
                             "ROLE:every=N[:at=K][:phase=P][:signal=S], "
                             f"got option {opt!r}")
        fields[key] = value
    if not (role in ("trainer", "controller") or role.removeprefix("rollout").isdigit()
            or role.removeprefix("relay").isdigit()):
        raise ValueError(f"fault injection {spec!r}: role must be trainer, controller, "
                         "rollout<i> or relay<i>")
    try:
        every = int(fields.get("every", "0"))
        at = int(fields.get("at", str(every)))
    except ValueError:
        raise ValueError(f"fault injection {spec!r}: every and at must be integers") from None
    if every < 0 or at < 1 or (every == 0 and "at" not in fields):
        raise ValueError(f"fault injection {spec!r}: needs every=N > 0 or at=K >= 1")
    phase = fields.get("phase", "train" if role == "trainer" else "generate")
    if phase not in ("train", "generate"):
        raise ValueError(f"fault injection {spec!r}: phase must be train or generate")
    sig = fields.get("signal", "kill")
    if sig not in ("kill", "stop") or (sig == "stop" and role == "controller"):
        raise ValueError(f"fault injection {spec!r}: signal must be kill or stop "
                         "(stop: not for the controller)")
    return Injection(role, every, at, phase, sig)  # type: ignore[arg-type]


def injection_due(inj: Injection, step: int) -> bool:
    """Whether `inj` fires during step `step` (the step that makes version `step`)."""
    if step < inj.at:
        return False
    return step == inj.at if inj.every == 0 else (step - inj.at) % inj.every == 0


@dataclass(frozen=True)
class RoleHealth:
    """What the controller observed of one role, at the snapshot's time."""

    name: str
    kind: RoleKind
    exit_code: int | None = None     # the process exited with this code
    error: str | None = None         # the role reported an exception
    busy_since_s: float | None = None
    """Trainer: when the running training step began. Rollout: since when it has had work
    placed on it. None: idle (no detection of hangs while idle)."""
    last_progress_s: float = 0.0     # trainer: last step returned; rollout: last token
    last_heartbeat_s: float = 0.0    # last heartbeat answered
    restarting: bool = False         # a restart is under way: not judged


@dataclass(frozen=True)
class Failure:
    role: str
    kind: RoleKind
    reason: str


def detect(now_s: float, roles: tuple[RoleHealth, ...], cfg: FaultConfig) -> tuple[Failure, ...]:
    failures = []
    for r in roles:
        if r.restarting:
            continue
        if r.exit_code is not None:
            failures.append(Failure(r.name, r.kind, f"process exited with code {r.exit_code}"))
        elif r.error is not None:
            failures.append(Failure(r.name, r.kind, f"raised: {r.error}"))
        elif r.busy_since_s is not None:
            quiet = now_s - max(r.busy_since_s, r.last_progress_s)
            if r.kind == "trainer" and quiet >= cfg.trainer_hang_s:
                failures.append(Failure(r.name, r.kind, f"no progress for {quiet:.0f}s "
                                        "during a training step"))
            elif r.kind == "rollout" and quiet >= cfg.rollout_stall_s:
                silent = now_s - r.last_heartbeat_s
                if silent >= cfg.heartbeat_timeout_s:
                    failures.append(Failure(r.name, r.kind, f"zero throughput for {quiet:.0f}s "
                                            f"and no heartbeat for {silent:.0f}s"))
    return tuple(failures)


@dataclass(frozen=True)
class RestartRole:
    role: str
    reason: str


@dataclass(frozen=True)
class RestartJob:
    reason: str


@dataclass(frozen=True)
class FaultHistory:
    """What escalation remembers: which roles made progress since they (re)started, the
    (role, step) of every failure, and one entry per failed restart of a role."""

    progressed: frozenset[str] = frozenset()
    failures: tuple[tuple[str, int], ...] = ()
    restart_failures: tuple[str, ...] = ()


def role_started(h: FaultHistory, role: str) -> FaultHistory:
    """A role (re)started successfully: its first step begins, its failed restarts end."""
    return dataclasses.replace(h, progressed=h.progressed - {role},
                               restart_failures=tuple(r for r in h.restart_failures if r != role))


def role_progressed(h: FaultHistory, role: str) -> FaultHistory:
    """The role finished a unit of work (trainer: a step; rollout: a trajectory)."""
    return h if role in h.progressed else dataclasses.replace(h, progressed=h.progressed | {role})


def restart_failed(h: FaultHistory, role: str) -> FaultHistory:
    return dataclasses.replace(h, restart_failures=h.restart_failures + (role,))


def escalate(h: FaultHistory, failure: Failure, *, step: int,
             cfg: FaultConfig) -> tuple[FaultHistory, RestartRole | RestartJob]:
    """The escalation rules of §2.4 (see the module docstring)."""
    role = failure.role
    seen_here = (role, step) in h.failures
    h = dataclasses.replace(h, failures=h.failures + ((role, step),))
    what = f"{role} {failure.reason} (step {step})"
    if cfg.policy == "job":
        return h, RestartJob(f"{what}; policy is to restart the job")
    if role not in h.progressed:
        return h, RestartJob(f"{what}, in its first step after starting: "
                             "a machine or code error that a role restart would repeat")
    if seen_here:
        return h, RestartJob(f"{what}, its second failure in this step: a reproducible fault")
    return h, RestartRole(role, failure.reason)


def restart_gave_up(h: FaultHistory, role: str, cfg: FaultConfig) -> bool:
    """After a failed restart: true when the role may not be tried again (rule 3)."""
    return h.restart_failures.count(role) > cfg.max_restart_failures
