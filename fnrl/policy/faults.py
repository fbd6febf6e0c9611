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
  that `lab/benchmarks/ettr.py` measures fnrl against.

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

# FaultConfig, Injection and parse_injection live in the config leaf (the command line
# is checked there); they are used here under the names callers know (F.parse_injection).
from fnrl.config import FaultConfig, Injection, parse_injection  # noqa: F401

RoleKind = Literal["trainer", "rollout"]


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
    exit_reason: str | None = None   # how, in words with the evidence (OOM killer, ...)
    error: str | None = None         # the role reported an exception
    busy_since_s: float | None = None
    """Trainer: when the running training step began. Rollout: since when it has had work
    placed on it. None: idle (no detection of hangs while idle)."""
    last_progress_s: float = 0.0     # trainer: last step returned; rollout: last token
    last_heartbeat_s: float = 0.0    # last heartbeat answered
    restarting: bool = False         # a restart is under way: not judged
    steps_done: int = 0              # trainer: steps completed since it (re)started
    longest_step_s: float = 0.0      # trainer: the longest of them


@dataclass(frozen=True)
class Failure:
    role: str
    kind: RoleKind
    reason: str


def trainer_window_s(r: RoleHealth, cfg: FaultConfig) -> float:
    """How long a training step may go without progress before the trainer has failed.

    Gap: the paper watches accelerator activity (zero for 5 minutes), which a slow but
    busy step never shows; fnrl sees only steps returning, so the window scales with the
    steps seen: trainer_hang_factor × the longest completed one, at least trainer_hang_s,
    and a first step after a (re)start, which compiles, gets trainer_first_step_s."""
    if r.steps_done == 0:
        return max(cfg.trainer_hang_s, cfg.trainer_first_step_s)
    return max(cfg.trainer_hang_s, cfg.trainer_hang_factor * r.longest_step_s)


def detect(now_s: float, roles: tuple[RoleHealth, ...], cfg: FaultConfig) -> tuple[Failure, ...]:
    failures = []
    for r in roles:
        if r.restarting:
            continue
        if r.exit_code is not None:
            failures.append(Failure(r.name, r.kind, f"process {r.exit_reason}" if r.exit_reason
                                    else f"process exited with code {r.exit_code}"))
        elif r.error is not None:
            failures.append(Failure(r.name, r.kind, f"raised: {r.error}"))
        elif r.busy_since_s is not None:
            quiet = now_s - max(r.busy_since_s, r.last_progress_s)
            if r.kind == "trainer" and quiet >= trainer_window_s(r, cfg):
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
    role: str = ""          # the role whose failure escalated


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


def decide_faults(now_s: float, roles: tuple[RoleHealth, ...], history: FaultHistory, *,
                  step: int, cfg: FaultConfig
                  ) -> tuple[FaultHistory, tuple[RestartRole | RestartJob, ...]]:
    """Detect, then escalate each failure: the loop acts on the decisions like on any
    other command (a RestartJob ends the attempt; the job runner restarts every role)."""
    decisions = []
    for failure in detect(now_s, roles, cfg):
        history, decision = escalate(history, failure, step=step, cfg=cfg)
        if isinstance(decision, RestartJob):
            decisions.append(dataclasses.replace(decision, role=failure.role))
            break
        decisions.append(decision)
    return history, tuple(decisions)


def check_injections(injections: tuple[Injection, ...], role_names: tuple[str, ...]) -> None:
    """Refuses, before the job starts, an injection naming a role the job does not have."""
    known = set(role_names) | {"controller"}
    for inj in injections:
        if inj.role not in known:
            raise ValueError(f"--faults.inject.kills names {inj.role!r}, but this job's roles are "
                             f"{', '.join(sorted(known))}")
