"""The automatic remat checked against XLA's compiled plan (fnrl.trainer.fit): the
logic runs on CPU, with limits placed between the policies' own compiled peaks."""

import dataclasses
import functools

import jax
import optax
import pytest

from fnrl.config import AlgoConfig, RunConfig, TrainerConfig
from fnrl.models.decoder import DecoderConfig, abstract_model, init_model
from fnrl.trainer.fit import abstract_batch, compiled_peak_bytes, fit_remat
from fnrl.trainer.step import compile_train_step, init_state

CFG = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def setup():
    cfg = dataclasses.replace(RunConfig(), trainer=TrainerConfig(remat="none", attention="xla",
                                                                 compute_dtype="float32"))
    optimizer = optax.adam(1e-3)
    state = jax.eval_shape(lambda: init_state(init_model(CFG, 0)[1], optimizer))
    batch = abstract_batch(cfg, rows=4, length=128)

    def build(tc):
        graphdef = abstract_model(CFG, remat=tc.remat)[0]
        return compile_train_step(graphdef, optimizer, AlgoConfig(), None, None)

    peaks = {r: compiled_peak_bytes(build(dataclasses.replace(cfg.trainer, remat=r))
                                    .lower(state, batch, None, None))
             for r in ("none", "dots", "full")}
    return cfg, build, (state, batch, None, None), peaks


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_the_compiled_plans_order_the_policies(setup):
    *_, peaks = setup
    assert peaks["full"] < peaks["dots"] < peaks["none"], peaks


@pytest.mark.parametrize("between,expected", [(("none", None), "none"),
                                              (("dots", "none"), "dots"),
                                              (("full", "dots"), "full")])
@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_fit_moves_to_the_least_remat_whose_compiled_plan_fits(setup, between, expected):
    cfg, build, args, peaks = setup
    fits, over = between
    limit = peaks[fits] if over is None else (peaks[fits] + peaks[over]) // 2
    tc, why, step, _ = fit_remat(cfg.trainer, {"remat": "planned"}, build=build, args=args,
                                 limit=limit)
    assert tc.remat == expected
    assert why["remat"].startswith("planned") and f"compiled plan of {expected}" in why["remat"]
    assert compiled_peak_bytes(step.lower(*args)) == peaks[expected]


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_nothing_fits_ends_at_full_and_says_so(setup):
    cfg, build, args, peaks = setup
    tc, why, *_ = fit_remat(cfg.trainer, {}, build=build, args=args, limit=peaks["full"] // 2)
    assert tc.remat == "full" and "compiled plan of full" in why["remat"]


def test_the_abstract_batch_follows_the_layout():
    packed = dataclasses.replace(RunConfig(), trainer=TrainerConfig(pack_rows=4))
    keys = set(abstract_batch(packed, 4, 64))
    assert {"adv_BxT", "segment_ids_BxT", "positions_BxT"} <= keys and "adv_B" not in keys
    assert "adv_B" in abstract_batch(RunConfig(), 8, 64)


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_the_trainer_role_fits_an_automatic_remat_to_its_device(tmp_path, tiny_model_dir,
                                                                 monkeypatch):
    """The role's accelerator path, run on CPU with a pretended device limit below every
    policy's compiled plan: it ends at full remat, says why, and still trains."""
    from fnrl.trainer.role import Trainer
    from tests.trainer.toy_batch import toy_batch

    resolve = Trainer._resolve

    def pretend_a_small_device(self, cfg, model_cfg):
        tc = resolve(self, cfg, model_cfg)
        self._device_limit = 1   # bytes: nothing fits
        return tc

    monkeypatch.setattr(Trainer, "_resolve", pretend_a_small_device)
    trainer = Trainer(RunConfig(run_dir=str(tmp_path)), tiny_model_dir, tmp_path)
    try:
        assert trainer.cfg.trainer.remat == "full"
        metrics, weights = trainer.train(toy_batch())
        assert metrics["update_skipped"] == 0.0 and trainer.version == 1
    finally:
        trainer.checkpoints.close()
