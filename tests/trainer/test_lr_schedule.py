"""The learning-rate schedule: warmup, decay to the run's last step, validation, and the
optimizer actually stepping at the scheduled rate."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fnrl.config import RunConfig
from fnrl.config.algo import AlgoConfig
from fnrl.trainer.step import lr_schedule, make_optimizer


def test_cosine_warms_up_then_decays_to_the_end_ratio_at_the_last_step():
    algo = AlgoConfig(learning_rate=1e-3, lr_schedule="cosine", lr_warmup_steps=4,
                      lr_end_ratio=0.1)
    rate = lr_schedule(algo, total_steps=24)
    rates = np.array([float(rate(i)) for i in range(30)])
    np.testing.assert_allclose(rates[:5], [0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3], rtol=1e-5)
    assert np.all(np.diff(rates[4:25]) < 0)                 # decays every step after warmup
    np.testing.assert_allclose(rates[14], 0.55e-3, rtol=1e-4)  # halfway: the mean of the ends
    np.testing.assert_allclose(rates[24:], 1e-4, rtol=1e-4)    # then holds at the end ratio


def test_linear_and_constant_schedules():
    linear = lr_schedule(AlgoConfig(learning_rate=1e-3, lr_schedule="linear"), total_steps=10)
    np.testing.assert_allclose([float(linear(i)) for i in (0, 5, 10, 20)],
                               [1e-3, 5e-4, 0.0, 0.0], atol=1e-9)
    warm = lr_schedule(AlgoConfig(learning_rate=1e-3, lr_warmup_steps=2))
    np.testing.assert_allclose([float(warm(i)) for i in (0, 1, 2, 100)],
                               [0.0, 5e-4, 1e-3, 1e-3], atol=1e-9)


def test_optimizer_steps_at_the_scheduled_rate():
    # With a constant gradient, Adam's first update moves each weight by about the rate
    # (the gradient over its own magnitude), so the step sizes trace the schedule.
    algo = AlgoConfig(learning_rate=1e-2, lr_schedule="linear", lr_warmup_steps=2,
                      max_grad_norm=1e9)
    opt = make_optimizer(algo, total_steps=6)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    moved = []
    for _ in range(7):
        updates, state = opt.update({"w": jnp.ones(3)}, state, params)
        params = optax.apply_updates(params, updates)
        moved.append(float(-updates["w"][0]))
    np.testing.assert_allclose(moved, [0.0, 5e-3, 1e-2, 7.5e-3, 5e-3, 2.5e-3, 0.0], atol=1e-6)


def test_schedule_is_validated_where_it_is_configured():
    with pytest.raises(ValueError, match="lr_schedule"):
        AlgoConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        AlgoConfig(lr_warmup_steps=-1)
    with pytest.raises(ValueError, match="lr_end_ratio"):
        AlgoConfig(lr_end_ratio=1.5)
    # A decay must end after the warmup: checked with the run's steps, and by the trainer.
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        RunConfig(steps=5, algo=AlgoConfig(lr_schedule="cosine", lr_warmup_steps=5))
    RunConfig(steps=5, algo=AlgoConfig(lr_warmup_steps=5))   # constant: no horizon needed
    with pytest.raises(ValueError, match="steps=0"):
        make_optimizer(AlgoConfig(lr_schedule="cosine"))


def test_the_main_jobs_decaying_rate_survives_its_config_file():
    # RunConfig's algo default is built by a function (a cosine decay), which the
    # trainer's config.json round trip must still read back as an AlgoConfig.
    from fnrl.config.base import from_dict, to_dict
    cfg = RunConfig()
    assert (cfg.algo.lr_schedule, cfg.algo.lr_end_ratio) == ("cosine", 0.1)
    assert AlgoConfig().lr_schedule == "constant"   # other users of AlgoConfig: unchanged
    back = from_dict(RunConfig, to_dict(cfg))
    assert back == cfg and isinstance(back.algo, AlgoConfig)
