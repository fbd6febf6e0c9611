"""The trainer role's side of bad input: a skipped step is neither checkpointed nor
published, and a failed save leaves the previous step to resume from."""

import os

import jax
import numpy as np
import optax
import pytest

from fnrl.config import MeshConfig, ModelConfig, RolloutConfig, RunConfig, TrainerConfig
from fnrl.trainer.checkpoint import Checkpointer
from fnrl.trainer.role import Trainer

from tests.trainer.toy_batch import toy_batch


def _host(state) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(state))]


@pytest.fixture
def trainer(tmp_path, tiny_model_dir):
    t = Trainer(RunConfig(run_dir=str(tmp_path)), tiny_model_dir, tmp_path)
    yield t
    t.checkpoints.close()


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
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


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
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


def _cfg(tmp_path, **trainer):
    return RunConfig(run_dir=str(tmp_path), trainer=TrainerConfig(**trainer))


def _other_batch(seed: int) -> dict:
    batch = toy_batch()
    batch["adv_B"] = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return batch


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_cadence_saves_every_k_and_a_restart_replays_back_to_the_same_version(
        tmp_path, tiny_model_dir):
    """checkpoint_every=3, keep 1: checkpoints 3 and 6 (only 6 kept), the batches since
    the newest logged (a skipped step's replaced by the next batch); a new trainer
    restores 6, replays the batch of 6 and holds exactly the state the first one had at
    7 (a restart comes back at the version it had)."""
    first = Trainer(_cfg(tmp_path, checkpoint_every=3, checkpoint_keep=1), tiny_model_dir,
                    tmp_path)
    try:
        for seed in range(5):
            first.train(_other_batch(seed))
        # A skipped step at version 5 logs its batch; the next good one replaces it.
        assert first.train(dict(toy_batch(), adv_B=np.full(8, np.nan, np.float32)))[1] is None
        assert first.batches.versions() == [3, 4, 5]
        first.train(_other_batch(5))
        assert first.version == 6 and first.checkpoints.latest_step() == 6
        first.train(_other_batch(6))
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6"]
        assert first.batches.versions() == [6]
        held = _host(first.state)
    finally:
        first.checkpoints.close()
    second = Trainer(_cfg(tmp_path, checkpoint_every=3, checkpoint_keep=1), tiny_model_dir,
                     tmp_path)
    try:
        assert second.version == 6 and second.replayed == 0   # the constructor only restores
        second.restore_latest()
        assert second.version == 7 and second.replayed == 1 and second.resumed_from == 7
        assert _host(second.state) == held   # the step is deterministic: bit for bit
    finally:
        second.checkpoints.close()


def test_a_restart_before_the_first_checkpoint_replays_from_the_model(tmp_path, tiny_model_dir):
    first = Trainer(_cfg(tmp_path, checkpoint_every=4), tiny_model_dir, tmp_path)
    for seed in range(2):
        first.train(_other_batch(seed))
    assert first.checkpoints.latest_step() is None
    held = _host(first.state)
    first.checkpoints.close()
    second = Trainer(_cfg(tmp_path, checkpoint_every=4), tiny_model_dir, tmp_path)
    second.restore_latest()
    assert second.version == 2 and second.replayed == 2 and _host(second.state) == held
    second.checkpoints.close()


@pytest.mark.slow   # a second trainer role in bfloat16: the whole suite's, not the inner loop's
def test_bf16_compute_bf16_serving_and_the_context_cap(tmp_path, tiny_model_dir):
    cfg = RunConfig(run_dir=str(tmp_path), trainer=TrainerConfig(compute_dtype="bfloat16"),
                    rollout=RolloutConfig(serve_dtype="bfloat16"),
                    model=ModelConfig(max_seq_len=16))
    t = Trainer(cfg, tiny_model_dir, tmp_path)
    try:
        # Master weights and moments stay float32; the servers get bfloat16.
        assert {x.dtype for x in jax.tree.leaves(t.state.params)} == {np.dtype(np.float32)}
        metrics, weights = t.train(toy_batch(seq_len=16))
        assert np.isfinite(metrics["loss"]) and t.version == 1
        assert {w.dtype.name for w in weights.values()} == {"bfloat16"}
        host = jax.device_get(t.state.params)
        np.testing.assert_array_equal(weights["model.norm.weight"],
                                      host["final_norm"]["scale"].astype(weights[
                                          "model.norm.weight"].dtype))
        with pytest.raises(ValueError, match="exceeds the run's context of 16"):
            t.train(toy_batch(seq_len=24))
    finally:
        t.checkpoints.close()


def test_the_optimizer_state_is_born_sharded_like_the_params(tmp_path, tiny_model_dir):
    t = Trainer(_cfg(tmp_path, mesh=MeshConfig(data=2, fsdp=2, tensor=2)), tiny_model_dir,
                tmp_path)
    try:
        emb = t.state.params["embedding"]
        assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
        params_sh = jax.tree.map(lambda x: x.sharding, t.state.params)
        for name in ("mu", "nu"):
            moments = optax.tree_utils.tree_get(t.state.opt_state, name)
            assert jax.tree.map(lambda x: x.sharding, moments) == params_sh
        assert t.train(toy_batch())[1] is not None
    finally:
        t.checkpoints.close()


def test_a_save_the_disk_has_no_room_for_is_said_and_the_run_goes_on(trainer, tmp_path,
                                                                     tiny_model_dir, monkeypatch):
    """A full disk fails the save half way (Orbax re-raises its writer's ENOSPC, wrapped):
    the temporary directory goes, the step is published, the metrics say so, and the
    batch stays logged so a restart replays it: nothing lost, no restart loop."""
    import errno

    trainer.train(toy_batch())
    ckpt = tmp_path / "checkpoints"

    def save(self, step, state, extra=None):
        (ckpt / f"{step}.orbax-checkpoint-tmp-7").mkdir()
        (ckpt / f"{step}.orbax-checkpoint-tmp-7" / "half").write_bytes(b"\0" * 100)

    def wait(self):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("async save failed") from err

    monkeypatch.setattr(Checkpointer, "save", save)
    monkeypatch.setattr(Checkpointer, "wait", wait)
    metrics, weights = trainer.train(toy_batch())
    monkeypatch.undo()
    assert weights is not None and trainer.version == 2
    assert metrics["checkpoint/no_space"] == 1.0 and metrics["checkpoint/versions_since_saved"] == 1
    assert sorted(os.listdir(ckpt)) == ["1"]                     # nothing left half written
    assert trainer.batches.versions() == [1]                    # the batch to replay
    after_two = _host(trainer.state)
    resumed = Trainer(RunConfig(run_dir=str(tmp_path)), tiny_model_dir, tmp_path)
    try:
        resumed.restore_latest()
        assert resumed.version == 2 and _host(resumed.state) == after_two
    finally:
        resumed.checkpoints.close()
    # Any other failure of a save is still an error (fnrl.shell.files.no_space).
    monkeypatch.setattr(Checkpointer, "wait", lambda self: (_ for _ in ()).throw(
        RuntimeError("permission denied")))
    with pytest.raises(RuntimeError, match="permission denied"):
        trainer.train(toy_batch())
