"""The trainer's side of the correctness gates (fnrl.trainer.controls): bounds refuse an
update inside the step, the learning-rate scale scales it, a rollback restores and
re-checkpoints, and a restarted trainer's replay applies the same controls."""

import math

import jax
import numpy as np
import pytest

from fnrl.config import RunConfig, TrainerConfig
from fnrl.trainer.controls import pack_controls, split_controls
from fnrl.trainer.role import Trainer, corrupt_weights

from tests.trainer.toy_batch import toy_batch


def _host(params) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(params))]


def _batch(seed=0, lr_scale=1.0, kl_bound=math.inf, rollback_to=-1):
    batch = toy_batch()
    batch["adv_B"] = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return {**batch, **pack_controls(lr_scale=lr_scale, upper={"mismatch/kl_k3": kl_bound,
                                                               "clip_frac": math.inf},
                                     lower={"mismatch/is_p01": 0.0}, rollback_to=rollback_to)}


@pytest.fixture
def make(tmp_path, tiny_model_dir):
    made = []

    def build(**trainer):
        t = Trainer(RunConfig(run_dir=str(tmp_path), trainer=TrainerConfig(**trainer)),
                    tiny_model_dir, tmp_path)
        made.append(t)
        return t
    yield build
    for t in made:
        t.checkpoints.close()


def test_controls_ride_in_the_arrays_and_split_back_out():
    batch, controls, rollback = split_controls(_batch(lr_scale=0.5, rollback_to=3))
    assert set(batch) == set(toy_batch())
    assert controls["lr_scale"] == np.float32(0.5) and rollback == 3
    assert controls["max"]["mismatch/kl_k3"] == np.inf and "mismatch/is_p01" in controls["min"]
    assert split_controls(toy_batch())[1] is None


def test_a_bound_refuses_the_update_but_the_version_advances(make):
    t = make()
    metrics, _ = t.train(_batch())
    assert metrics["gate_refused"] == 0.0 and metrics["update_ratio"] > 0
    before = _host(t.state.params)
    # The toy batch's behaviour log-probs are far from the model's: any tiny bound refuses.
    metrics, weights = t.train(_batch(seed=1, kl_bound=1e-9))
    assert metrics["gate_refused"] == 1.0 and metrics["update_skipped"] == 0.0
    assert metrics["mismatch/kl_k3"] > 1e-9
    assert _host(t.state.params) == before and t.version == 2
    # Published and checkpointed: the rollouts leave the version that made the bad data.
    assert weights is not None and t.checkpoints.latest_step() == 2


def test_lr_scale_scales_the_update(make, tmp_path):
    t = make()
    m_full, _ = t.train(_batch(lr_scale=1.0))
    first = _host(t.state.params)
    m_zero, _ = t.train(_batch(seed=1, lr_scale=0.0))
    assert m_zero["update_ratio"] == 0.0 and _host(t.state.params) == first
    m_tenth, _ = t.train(_batch(seed=2, lr_scale=0.1))
    m_one, _ = t.train(_batch(seed=3, lr_scale=1.0))
    # Adam's step at a tenth of the scale is about a tenth as large (its moments differ
    # only by one more batch).
    assert 0.05 < m_tenth["update_ratio"] / m_one["update_ratio"] < 0.2


def test_rollback_restores_the_checkpoint_under_the_current_version(make, tiny_model_dir,
                                                                    tmp_path):
    t = make(checkpoint_keep=3)
    t.train(_batch(0))
    at_one = _host(t.state.params)
    t.train(_batch(1))
    t.train(_batch(2))
    assert t.checkpoints.all_steps() == [1, 2, 3]
    # Scale 0: the step after the rollback changes nothing, so the restored params show.
    metrics, weights = t.train(_batch(3, lr_scale=0.0, rollback_to=1))
    assert metrics["gate/rolled_back_to"] == 1.0 and t.version == 4
    assert _host(t.state.params) == at_one and weights is not None
    # Version 3's checkpoint was replaced by the restored state: a restart resumes there.
    again = make(checkpoint_keep=3)
    assert again.version == 4 and _host(again.state.params) == at_one


def test_rollback_without_a_checkpoint_changes_nothing(make):
    t = make(checkpoint_keep=1)
    t.train(_batch(0))
    t.train(_batch(1))
    before = _host(t.state.params)
    metrics, _ = t.train(_batch(2, lr_scale=0.0, rollback_to=1))
    assert metrics["gate/rolled_back_to"] == -1.0 and _host(t.state.params) == before


def test_rollback_to_version_0_rebuilds_the_pretrained_model(make):
    """Version 0 is never checkpointed (it is the model directory): a first step that
    trips a rollback gate goes back to it."""
    t = make()
    at_zero = _host(t.state.params)
    t.train(_batch(0))
    assert _host(t.state.params) != at_zero and 0 not in t.checkpoints.all_steps()
    metrics, weights = t.train(_batch(1, lr_scale=0.0, rollback_to=0))
    assert metrics["gate/rolled_back_to"] == 0.0 and t.version == 2
    assert _host(t.state.params) == at_zero and weights is not None


def test_replay_applies_the_logged_lr_scale(make):
    first = make(checkpoint_every=4)
    for seed, scale in enumerate((1.0, 0.1, 0.01)):
        first.train(_batch(seed, lr_scale=scale))
    held = _host(first.state.params)
    first.checkpoints.close()
    second = make(checkpoint_every=4)
    second.restore_latest()
    assert second.version == 3 and second.replayed == 3 and _host(second.state.params) == held


def test_corrupt_weights_perturbs_every_varying_tensor():
    w = {"a": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8),
         "norm": np.ones(8, np.float32)}
    out = corrupt_weights(w, 0.5, seed=0)
    assert out["a"].dtype == np.float32 and not np.array_equal(out["a"], w["a"])
    assert np.array_equal(out["norm"], w["norm"])   # std 0: a constant tensor stays
    assert 0.2 < np.std(out["a"] - w["a"]) / np.std(w["a"]) < 0.8
