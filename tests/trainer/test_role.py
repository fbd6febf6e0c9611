"""The trainer role's side of bad input: a skipped step is neither checkpointed nor
published, and a failed save leaves the previous step to resume from."""

import os

import jax
import numpy as np
import pytest

from fnrl.config import RunConfig
from fnrl.trainer.checkpoint import Checkpointer
from fnrl.trainer.role import Trainer

from toy_batch import toy_batch


def _host(state) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(state))]


@pytest.fixture
def trainer(tmp_path, tiny_model_dir):
    t = Trainer(RunConfig(run_dir=str(tmp_path)), tiny_model_dir, tmp_path)
    yield t
    t.checkpoints.close()


def test_a_skipped_step_is_not_checkpointed_or_published(trainer, tmp_path):
    metrics, weights = trainer.train(toy_batch())
    assert metrics["update_skipped"] == 0.0 and weights is not None and trainer.version == 1
    before = _host(trainer.state)
    bad = dict(toy_batch(), adv_B=np.full(8, np.nan, np.float32))
    metrics, weights = trainer.train(bad)
    # None is what tells the serve loop not to publish (fnrl.trainer.role.serve).
    assert metrics["update_skipped"] == 1.0 and weights is None and trainer.version == 1
    assert _host(trainer.state) == before
    assert trainer.checkpoints.latest_step() == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]


def test_a_failed_save_leaves_the_previous_step_to_resume_from(trainer, tmp_path,
                                                              tiny_model_dir, monkeypatch):
    trainer.train(toy_batch())
    after_one = _host(trainer.state)
    save = Checkpointer.save
    # The arrays are written, then the commit fails (as a full disk would fail it).
    monkeypatch.setattr(Checkpointer, "save", lambda self, step, state, extra=None: save(
        self, step, state, {"unwritable": object()}))
    with pytest.raises(TypeError, match="not JSON serializable"):
        trainer.train(toy_batch())
    monkeypatch.undo()
    resumed = Trainer(RunConfig(run_dir=str(tmp_path)), tiny_model_dir, tmp_path)
    try:
        assert resumed.resumed_from == 1 and _host(resumed.state) == after_one
        assert resumed.train(toy_batch())[1] is not None and resumed.version == 2
        assert resumed.checkpoints.latest_step() == 2
    finally:
        resumed.checkpoints.close()
