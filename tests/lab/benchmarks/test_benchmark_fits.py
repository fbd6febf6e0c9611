"""Pure pieces of lab/benchmarks/ettr.py and lab/benchmarks/weight_sync.py: the old (evaluation
charged) ETTR, and the cost model fitted on some p and predicting the others."""

import numpy as np
import pytest

from lab.benchmarks import ettr

MIB = 2**20


def test_ettr_with_evaluation_charged_adds_it_to_every_unit_and_the_wall():
    # 4 units, 98 s of wall and 80 role-seconds down with the second attempt's 12 s of
    # evaluation left out; the first attempt's evaluation precedes the start.
    s = {"ettr": 1 - 80 / 392, "ettr_units": 4, "wall_s_all_attempts": 98.0,
         "role_down_s_all": 80.0, "eval_before_start_s": [7.0, 12.0]}
    assert ettr.ettr_eval_charged(s) == pytest.approx(1 - (80 + 48) / (4 * 110))
    assert ettr.ettr_eval_charged({**s, "eval_before_start_s": [7.0]}) == s["ettr"]


def test_down_per_kill_reads_gaps_for_job_restarts_and_recoveries_otherwise():
    run = {"summary": {"restart_gaps_s": [3.0, 4.0]},
           "events": [{"event": "recovered", "role": "trainer", "down_s": 2.5},
                      {"event": "recovered", "role": "rollout0", "down_s": 9.0},
                      {"event": "failure", "role": "trainer"}]}
    assert ettr.down_per_kill(run, job=True) == [3.0, 4.0]
    assert ettr.down_per_kill(run, job=False) == [2.5]


def test_the_cost_model_fitted_on_small_p_predicts_larger_p():
    weight_sync = pytest.importorskip("lab.benchmarks.weight_sync")
    chunk = 32 * MIB
    t_byte, t_start = 1 / 4e9, 3e-3

    def true_t(p, size):
        return float(np.dot(weight_sync.laminar_terms(p, size, chunk), (t_byte, t_start)))

    fit = [(p, s, true_t(p, s)) for s in (10 * MIB, 100 * MIB) for p in (1, 2)]
    got = weight_sync.fit_laminar(fit, chunk)
    assert got == pytest.approx((t_byte, t_start), rel=1e-6)
    # 100 MB is 4 chunks: T = (p + 3)(25 MB · T_byte + T_start), so T(4)/T(1) = 7/4.
    a4 = np.dot(weight_sync.laminar_terms(4, 100 * MIB, chunk), got)
    assert a4 / true_t(1, 100 * MIB) == pytest.approx(7 / 4)
