"""Configuration of fault detection and injection (fnrl.policy.faults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fnrl.config.base import check, positive


@dataclass(frozen=True, kw_only=True)
class FaultInjection:
    """Faults injected on purpose, to test detection, recovery and the gates."""

    kills: tuple[str, ...] = ()
    """Each `ROLE:every=N[:at=K][:phase=train|generate][:signal=kill|stop]`: SIGKILL (or
    SIGSTOP: a hang, which only detection windows find) the role (trainer, rollout<i>,
    relay<i>, controller) at step K, K+N, ... (K defaults to N) during the given phase
    (default: train for the trainer, generate otherwise)."""
    seed: int = 0
    """Seed of the delay into the phase at which an injected kill lands."""
    corrupt_publish: int = 0
    """The trainer publishes the weights of this version (> 0) with Gaussian noise of
    `noise` × each tensor's std added, so rollouts sample from wrong weights while the
    trainer keeps true ones (tests of the gates, fnrl.policy.gates)."""
    noise: float = 1.0
    bad_logprobs: int = 0
    """The controller records wrong behaviour log-probs (each shifted by uniform noise in
    [-logprob_shift, 0]) in the batch that trains this version (> 0). A learning rate
    100x too high needs no flag: it is `--algo.learning-rate`."""
    logprob_shift: float = 2.0

    def __post_init__(self):
        object.__setattr__(self, "kills", tuple(self.kills))   # a JSON list reads back
        for name in ("corrupt_publish", "bad_logprobs"):
            check(getattr(self, name) >= 0, "FaultInjection", name, getattr(self, name),
                  "must be >= 0 (0: off)")
        positive(self, "noise", "logprob_shift")
        for spec in self.kills:
            parse_injection(spec)   # a bad spec is named before anything starts


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """How failures are detected and answered (`--faults.*`)."""

    policy: Literal["role", "job"] = "role"
    """"role": restart only the failed role (RobustRL); "job": restart every role from
    the checkpoint on any failure (the whole-job baseline)."""
    trainer_hang_s: float = 300.0
    """No progress for this long while a training step runs: the trainer has failed
    (the window's floor: see `trainer_hang_factor` and `trainer_first_step_s`)."""
    trainer_hang_factor: float = 4.0
    """...or for this many times the longest step the trainer has completed, when that
    is longer: a large model's step on a slow machine can outlast the floor."""
    trainer_first_step_s: float = 1800.0
    """The window of the trainer's first step after it (re)started, which includes the
    step's compilation (minutes for a 0.5B model on CPU); never below trainer_hang_s."""
    rollout_stall_s: float = 60.0
    """Zero throughput for this long while work is placed on a rollout: suspect."""
    heartbeat_timeout_s: float = 10.0
    """A suspect rollout whose heartbeat has not answered for this long has failed."""
    node_timeout_s: float = 30.0
    """A Ray node whose host has not answered for this long is lost (hung or gone): its
    roles are handled as lost ones and move to the other nodes, which never wait on it
    (fnrl.backends.ray_cluster). Ray's own node health check declares a node dead after
    about 30 s too."""
    max_restart_failures: int = 1
    """Failed restarts of one role that are retried before the job restarts (paper: 1)."""
    max_job_restarts: int = 3
    """Whole-job restarts before the run gives up with the last failure's error."""
    trainer_standby: bool = False
    """Keep a warm spare trainer (built, compiled, waiting) that takes over a failed
    trainer by restoring the newest checkpoint: RobustRL's warm standby (§3.2, a borrowed
    rollout machine), at the cost of a second trainer's memory."""
    inject: FaultInjection = field(default_factory=FaultInjection)
    """Faults to inject (tests and benchmarks): `--faults.inject.*`."""

    def __post_init__(self):
        positive(self, "trainer_hang_s", "trainer_hang_factor", "trainer_first_step_s",
                 "rollout_stall_s", "heartbeat_timeout_s", "node_timeout_s")
        check(self.policy in ("role", "job"), "FaultConfig", "policy", self.policy,
              "must be 'role' or 'job'")
        for name in ("max_restart_failures", "max_job_restarts"):
            check(getattr(self, name) >= 0, "FaultConfig", name, getattr(self, name),
                  "must be >= 0")


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
