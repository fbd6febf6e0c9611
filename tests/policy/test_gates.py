"""Golden tests of every correctness-gate rule and of the gates' state machine."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnrl.config import GATE_RULE_NAMES, GatesConfig, RunConfig
from fnrl.policy import gates
from fnrl.policy.gates import LowerLR, Rollback, Skip, StepTelemetry, Stop

CFG = GatesConfig()


def clean(version: int, **figures) -> StepTelemetry:
    """A step like the default runs' (docs/gates.md), with `figures` overridden."""
    base = dict(mismatch_kl=3e-4, is_p01=0.95, is_p99=1.05, clip_frac=0.003, grad_norm=0.2,
                update_ratio=1e-3, reward_mean=0.5, response_len_mean=70.0)
    return StepTelemetry(version=version, new_version=version + 1, **{**base, **figures})


def run(steps, cfg=CFG, state=None):
    state = state or gates.initial_state(0)
    fired = []
    for tel in steps:
        state, firings = gates.evaluate(state, tel, cfg)
        fired.append(firings)
    return state, fired


def test_registry_matches_config_names():
    assert tuple(gates.RULES) == GATE_RULE_NAMES


def test_clean_steps_fire_nothing_and_advance_last_good():
    state, fired = run([clean(v) for v in range(20)])
    assert all(f == () for f in fired)
    assert state.last_good == 20 and state.consecutive_skips == 0 and state.lr_scale == 1.0


@pytest.mark.parametrize("rule,figures", [
    ("mismatch_kl", dict(mismatch_kl=0.06)),
    ("mismatch_kl", dict(mismatch_kl=float("nan"))),
    ("is_weight", dict(is_p99=2.5)),
    ("is_weight", dict(is_p01=0.4)),
    ("clip_frac", dict(clip_frac=0.25)),
])
def test_each_skip_rule_fires_alone_with_its_figures(rule, figures):
    state, fired = run([clean(0, **figures)])
    (firing,) = fired[0]
    assert firing.rule == rule and firing.actions == (Skip(),) and firing.version == 1
    key = next(iter(figures))
    assert key in firing.figures
    assert state.consecutive_skips == 1
    # The refused update left version 1 with version 0's (good) weights.
    assert state.last_good == 1


def test_bounds_are_inclusive_and_float32_like_the_trainers():
    upper, lower = gates.limits(gates.initial_state(0), CFG)
    at_bound = clean(0, mismatch_kl=upper["mismatch/kl_k3"], is_p99=upper["mismatch/is_p99"],
                     is_p01=lower["mismatch/is_p01"], clip_frac=upper["clip_frac"])
    assert run([at_bound])[1] == [()]
    just_over = clean(0, mismatch_kl=float(np.nextafter(np.float32(upper["mismatch/kl_k3"]),
                                                        np.float32(1))))
    assert [f.rule for f in run([just_over])[1][0]] == ["mismatch_kl"]


def test_limits_name_the_trainer_metrics_of_enabled_rules_only():
    upper, lower = gates.limits(gates.initial_state(0), CFG)
    assert set(upper) == {"mismatch/kl_k3", "mismatch/is_p99", "clip_frac", "grad_norm"}
    assert set(lower) == {"mismatch/is_p01"}
    assert upper["grad_norm"] == math.inf   # no history yet
    upper, lower = gates.limits(gates.initial_state(0), GatesConfig(rules=("update_ratio",)))
    assert upper == {} and lower == {}


def test_grad_norm_spike_fires_once_history_exists():
    # Zero norms (every group tied) are not history: they say nothing about scale.
    norms = [0.0, 0.2, 0.3, 0.0, 0.25, 0.2, 0.3]
    state, fired = run([clean(v, grad_norm=g) for v, g in enumerate(norms)])
    assert all(f == () for f in fired) and len(state.grad_norms) == 5
    assert gates.limits(state, CFG)[0]["grad_norm"] == pytest.approx(2.5)   # 10 × median 0.25
    state, fired = run([clean(7, grad_norm=2.6)], state=state)
    assert [f.rule for f in fired[0]] == ["grad_norm"]
    assert fired[0][0].figures["grad_norm"] == pytest.approx(2.6)
    # A spike does not enter the history its median is taken over.
    assert len(state.grad_norms) == 5


def test_grad_norm_never_fires_at_or_below_the_floor():
    state, _ = run([clean(v, grad_norm=0.01) for v in range(6)])
    assert gates.limits(state, CFG)[0]["grad_norm"] == pytest.approx(1.0)
    assert run([clean(6, grad_norm=0.9)], state=state)[1] == [()]


def test_grad_norm_needs_history():
    assert run([clean(0, grad_norm=100.0)])[1] == [()]


def test_update_ratio_rolls_back_and_lowers_the_rate_then_escalates():
    cfg = GatesConfig(max_rollbacks=2)
    state, fired = run([clean(0), clean(1), clean(2, update_ratio=0.2)], cfg)
    (firing,) = fired[2]
    assert firing.rule == "update_ratio"
    assert firing.actions == (Rollback(2), LowerLR(0.1, pytest.approx(0.1)))
    assert state.lr_scale == pytest.approx(0.1) and state.rollbacks == 1
    # The trainer re-checkpoints the restored weights under version 3: good from there.
    assert state.last_good == 3
    state, fired = run([clean(3, update_ratio=0.02)], cfg, state)
    assert fired[0][0].actions == (Rollback(3), LowerLR(0.1, pytest.approx(0.01)))
    state, fired = run([clean(4, update_ratio=0.05)], cfg, state)
    assert fired[0][0].actions == (Stop(),) and state.stopped
    # A stopped gate judges nothing more.
    assert run([clean(5, mismatch_kl=1.0)], cfg, state)[1] == [()]


def test_update_ratio_ignores_refused_and_nonfinite_steps():
    refused = dataclasses.replace(clean(0, update_ratio=0.5, mismatch_kl=1.0), refused=True)
    assert [f.rule for f in run([refused])[1][0]] == ["mismatch_kl"]


def test_nonfinite_skips_and_keeps_last_good():
    tel = StepTelemetry(version=4, new_version=4, nonfinite=True, grad_norm=float("nan"))
    state, fired = run([tel], state=gates.initial_state(4))
    assert [f.rule for f in fired[0]] == ["nonfinite"]
    assert state.last_good == 4


def test_consecutive_skips_escalate_to_stop_naming_the_rule():
    cfg = GatesConfig(max_consecutive_skips=3)
    steps = [clean(v, mismatch_kl=0.5) for v in range(4)]
    state, fired = run(steps, cfg)
    assert all(len(f) == 1 for f in fired[:3])
    last = fired[3]
    assert [f.rule for f in last] == ["mismatch_kl", "mismatch_kl+max_consecutive_skips"]
    assert last[1].actions == (Stop(),) and last[1].figures["consecutive_skips"] == 4
    assert state.stopped


def test_a_clean_step_resets_the_skip_count():
    cfg = GatesConfig(max_consecutive_skips=2)
    steps = [clean(0, mismatch_kl=0.5), clean(1, mismatch_kl=0.5), clean(2),
             clean(3, mismatch_kl=0.5), clean(4, mismatch_kl=0.5)]
    state, fired = run(steps, cfg)
    assert not state.stopped and state.consecutive_skips == 2


def test_reward_collapse_stops_after_a_full_window():
    cfg = GatesConfig(window=4)
    good = [clean(v, reward_mean=0.6) for v in range(4)]
    bad = [clean(4 + v, reward_mean=0.0) for v in range(4)]
    state, fired = run(good + bad, cfg)
    rules = [[f.rule for f in fs] for fs in fired]
    # The window mean falls 0.45, 0.3, 0.15 (< 0.3 × 0.6 = 0.18): fires at the third bad step.
    assert rules[:6] == [[]] * 6 and rules[6] == ["reward_collapse"]
    assert fired[6][0].actions == (Stop(),)
    assert fired[6][0].figures["best_window_mean"] == pytest.approx(0.6)


def test_reward_collapse_needs_a_meaningful_best():
    cfg = GatesConfig(window=2, min_reward=0.1)
    steps = [clean(v, reward_mean=r) for v, r in enumerate([0.05, 0.05, 0.0, 0.0])]
    assert all(f == () for f in run(steps, cfg)[1])


@pytest.mark.parametrize("lengths,fires", [([70] * 4 + [10] * 4, True),
                                           ([70] * 4 + [400] * 4, True),
                                           ([70] * 4 + [40] * 4, False)])
def test_length_collapse(lengths, fires):
    cfg = GatesConfig(window=4)
    steps = [clean(v, response_len_mean=float(n)) for v, n in enumerate(lengths)]
    state, fired = run(steps, cfg)
    assert any(f.rule == "length_collapse" for fs in fired for f in fs) == fires


def test_a_failed_rollback_stops():
    tel = dataclasses.replace(clean(5), rolled_back_to=-1)
    state, fired = run([tel], state=gates.initial_state(5))
    assert fired[0][0].rule == "rollback" and fired[0][0].actions == (Stop(),)


def test_disabled_rules_never_fire():
    cfg = GatesConfig(rules=())
    bad = clean(0, mismatch_kl=9.0, is_p99=9.0, clip_frac=0.9, update_ratio=9.0)
    assert run([bad], cfg)[1] == [()]


def test_firing_record_is_json_ready():
    import json
    _, fired = run([clean(0, update_ratio=0.5)])
    rec = fired[0][0].record()
    assert json.loads(json.dumps(rec))["actions"] == [
        {"action": "rollback", "to_version": 0}, {"action": "lowerlr", "factor": 0.1,
                                                  "scale": pytest.approx(0.1)}]


def test_telemetry_from_trainer_metrics():
    metrics = {"mismatch/kl_k3": 0.1, "mismatch/is_p01": 0.9, "mismatch/is_p99": 1.1,
               "ppo_clip/clip_frac": 0.02, "grad_norm": 0.3, "update_ratio": 1e-3,
               "loss": 0.1, "update_skipped": 0.0, "gate_refused": 1.0}
    tel = gates.telemetry(metrics, {"reward_mean": 0.4, "response_len_mean": 50.0},
                          version=3, new_version=4)
    assert (tel.mismatch_kl, tel.clip_frac, tel.refused, tel.nonfinite) == (0.1, 0.02, True, False)
    bare = gates.telemetry({"update_skipped": 0.0}, {}, version=0, new_version=1)
    assert bare.mismatch_kl is None and not bare.nonfinite
    assert gates.telemetry({"loss": float("nan")}, {}, version=0, new_version=0).nonfinite


def test_default_run_config_has_gates_and_validates_names():
    assert RunConfig().gates.rules == GATE_RULE_NAMES
    with pytest.raises(ValueError, match="GatesConfig.rules='bogus'"):
        GatesConfig(rules=("bogus",))
    with pytest.raises(ValueError, match="lr_factor"):
        GatesConfig(lr_factor=1.5)
    with pytest.raises(ValueError, match="bad_logprobs"):
        dataclasses.replace(RunConfig().faults.inject, bad_logprobs=-1)


figure = st.floats(min_value=0.0, max_value=10.0) | st.just(float("nan"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(figure, figure, figure, st.floats(0, 1), st.floats(0, 200)),
                min_size=1, max_size=30))
def test_state_machine_invariants(rows):
    """Over any sequence: a skip rule fires exactly when the step's figures break the
    bounds `limits` gives the trainer; last_good never passes the newest version; the
    rate only falls; a stopped gate stays stopped."""
    cfg = GatesConfig(window=3, max_consecutive_skips=50, max_rollbacks=50)
    state = gates.initial_state(0)
    for v, (kl, p99, ratio, reward, length) in enumerate(rows):
        upper, lower = gates.limits(state, cfg)
        tel = clean(v, mismatch_kl=kl, is_p99=p99, update_ratio=ratio / 100,
                    reward_mean=reward, response_len_mean=length)
        breaks = not (kl <= upper["mismatch/kl_k3"] and p99 <= upper["mismatch/is_p99"])
        before = state
        state, firings = gates.evaluate(state, tel, cfg)
        if before.stopped:
            assert firings == () and state == before
            continue
        skip_rules = {f.rule for f in firings} & {"mismatch_kl", "is_weight"}
        assert bool(skip_rules) == breaks
        assert state.last_good <= tel.new_version
        assert state.lr_scale <= before.lr_scale
        assert state.stopped == (before.stopped or any(Stop() in f.actions for f in firings))
