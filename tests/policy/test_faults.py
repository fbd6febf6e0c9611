"""Detection and escalation rules of fnrl.policy.faults (RobustRL §2.2-2.4)."""

import pytest

from fnrl.policy import faults as F

CFG = F.FaultConfig(trainer_hang_s=300, rollout_stall_s=60, heartbeat_timeout_s=10)


def _trainer(**kw):
    return F.RoleHealth("trainer", "trainer", **kw)


def _rollout(**kw):
    return F.RoleHealth("rollout0", "rollout", **kw)


def test_exit_and_exception_are_failures_at_once():
    (f,) = F.detect(5.0, (_trainer(exit_code=-9),), CFG)
    assert f.role == "trainer" and "code -9" in f.reason
    (f,) = F.detect(5.0, (_rollout(error="CUDA error"),), CFG)
    assert "CUDA error" in f.reason


def test_trainer_hang_counts_only_during_the_training_phase():
    idle = _trainer(busy_since_s=None, last_progress_s=0.0)
    assert F.detect(10_000.0, (idle,), CFG) == ()
    training = _trainer(busy_since_s=100.0, last_progress_s=50.0, steps_done=3,
                        longest_step_s=20.0)
    assert F.detect(399.0, (training,), CFG) == ()
    (f,) = F.detect(400.0, (training,), CFG)
    assert "no progress for 300s" in f.reason


def test_the_trainer_window_grows_with_its_steps_and_covers_a_compiling_first_step():
    cfg = F.FaultConfig(trainer_hang_s=300, trainer_hang_factor=4, trainer_first_step_s=1800)
    # A 0.5B model's step on CPU: 400 s each; the floor alone would fail every step.
    slow = _trainer(busy_since_s=0.0, steps_done=2, longest_step_s=400.0)
    assert F.trainer_window_s(slow, cfg) == 1600.0
    assert F.detect(1599.0, (slow,), cfg) == ()
    (f,) = F.detect(1600.0, (slow,), cfg)
    assert "no progress for 1600s" in f.reason
    # The first step after a (re)start compiles: its own, longer window.
    first = _trainer(busy_since_s=0.0, steps_done=0, longest_step_s=400.0)
    assert F.trainer_window_s(first, cfg) == 1800.0
    assert F.detect(1700.0, (first,), cfg) == ()
    # Fast steps keep the floor.
    fast = _trainer(busy_since_s=0.0, steps_done=5, longest_step_s=2.0)
    assert F.trainer_window_s(fast, cfg) == 300.0
    with pytest.raises(ValueError, match="trainer_hang_factor"):
        F.FaultConfig(trainer_hang_factor=0)


def test_a_slow_rollout_that_answers_heartbeats_is_not_failed():
    slow = _rollout(busy_since_s=0.0, last_progress_s=0.0, last_heartbeat_s=119.0)
    assert F.detect(120.0, (slow,), CFG) == ()            # suspect, heartbeat fine
    stalled = _rollout(busy_since_s=0.0, last_progress_s=0.0, last_heartbeat_s=105.0)
    (f,) = F.detect(120.0, (stalled,), CFG)               # suspect and silent
    assert "zero throughput for 120s" in f.reason and "no heartbeat for 15s" in f.reason
    recent = _rollout(busy_since_s=0.0, last_progress_s=100.0, last_heartbeat_s=0.0)
    assert F.detect(120.0, (recent,), CFG) == ()          # tokens 20 s ago
    idle = _rollout(busy_since_s=None, last_heartbeat_s=0.0)
    assert F.detect(1000.0, (idle,), CFG) == ()           # no work: zero throughput is fine


def test_a_role_being_restarted_is_not_judged():
    assert F.detect(5.0, (_trainer(exit_code=-9, restarting=True),), CFG) == ()


def _failure(role="trainer"):
    return F.Failure(role, "trainer" if role == "trainer" else "rollout", "exited")


def test_escalation_rules():
    h = F.role_started(F.FaultHistory(), "trainer")
    # Rule 1: failure in the first step after the job started.
    _, d = F.escalate(h, _failure(), step=0, cfg=CFG)
    assert isinstance(d, F.RestartJob) and "first step" in d.reason
    h = F.role_progressed(h, "trainer")
    h, d = F.escalate(h, _failure(), step=7, cfg=CFG)
    assert d == F.RestartRole("trainer", "exited")
    # Rule 1 again: the restarted trainer fails before finishing a step.
    h = F.role_started(h, "trainer")
    _, d = F.escalate(h, _failure(), step=7, cfg=CFG)
    assert isinstance(d, F.RestartJob)
    # Rule 2: it did progress, but fails a second time in step 7... (a retried step).
    h2 = F.role_progressed(h, "trainer")
    _, d = F.escalate(h2, _failure(), step=7, cfg=CFG)
    assert isinstance(d, F.RestartJob) and "second failure" in d.reason
    # A failure in a later step is a new fault.
    _, d = F.escalate(h2, _failure(), step=8, cfg=CFG)
    assert isinstance(d, F.RestartRole)
    # Another role's failure in the same step is independent.
    h3 = F.role_progressed(F.role_started(h2, "rollout0"), "rollout0")
    _, d = F.escalate(h3, _failure("rollout0"), step=7, cfg=CFG)
    assert isinstance(d, F.RestartRole)


def test_rule_3_one_failed_restart_is_retried_a_second_is_not():
    h = F.FaultHistory()
    h = F.restart_failed(h, "rollout1")
    assert not F.restart_gave_up(h, "rollout1", CFG)
    h = F.restart_failed(h, "rollout1")
    assert F.restart_gave_up(h, "rollout1", CFG)
    assert not F.restart_gave_up(F.role_started(h, "rollout1"), "rollout1", CFG)


def test_job_policy_restarts_the_job_on_every_failure():
    cfg = F.FaultConfig(policy="job")
    h = F.role_progressed(F.role_started(F.FaultHistory(), "trainer"), "trainer")
    _, d = F.escalate(h, _failure(), step=5, cfg=cfg)
    assert isinstance(d, F.RestartJob)


def test_injection_specs():
    inj = F.parse_injection("trainer:every=10")
    assert inj == F.Injection("trainer", 10, 10, "train")
    assert [s for s in range(1, 40) if F.injection_due(inj, s)] == [10, 20, 30]
    once = F.parse_injection("rollout1:at=3")
    assert once.phase == "generate"
    assert [s for s in range(1, 40) if F.injection_due(once, s)] == [3]
    assert [s for s in range(1, 20) if F.injection_due(F.parse_injection("relay1:every=5:at=2"), s)] \
        == [2, 7, 12, 17]
    assert F.parse_injection("rollout0:at=2:signal=stop").signal == "stop"
    for bad in ("controller:at=2:signal=stop", "trainer:at=2:signal=term", "gpu:every=3", "trainer:every=x", "trainer:often=3", "trainer", "trainer:every=2:phase=eat"):
        with pytest.raises(ValueError, match="fault injection"):
            F.parse_injection(bad)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        F.FaultConfig(heartbeat_timeout_s=0)
