import pytest

from fnrl.config import AlgoConfig, RunConfig, from_dict, to_dict


def test_invalid_value_names_field():
    with pytest.raises(ValueError, match=r"AlgoConfig.clip_low=1.5"):
        AlgoConfig(clip_low=1.5)
    with pytest.raises(ValueError, match=r"group_size"):
        AlgoConfig(group_size=1)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="unknown config key.*lerning_rate"):
        from_dict(RunConfig, {"algo": {"lerning_rate": 1e-3}})


def test_round_trip():
    cfg = RunConfig(steps=3, algo=AlgoConfig(group_size=4))
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


def test_cli_rejects_unknown_flag(capsys):
    from fnrl.experiments.math_grpo import main
    with pytest.raises(SystemExit):
        main(["--algo.lerning-rate", "0.1"])


def test_head_size_vllm_cannot_serve_is_rejected_up_front():
    from fnrl.config import ModelConfig
    with pytest.raises(ValueError, match="hidden_size/num_attention_heads=16"):
        ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def test_missing_model_files_are_named(tmp_path, capsys):
    from fnrl.experiments.math_grpo import main
    model = tmp_path / "model"
    model.mkdir()
    assert main(["--model.model-dir", str(model), "--run-dir", str(tmp_path / "run")]) == 2
    assert "config.json" in capsys.readouterr().err
    (model / "config.json").write_text("{}")
    assert main(["--model.model-dir", str(model), "--run-dir", str(tmp_path / "run")]) == 2
    assert "missing required keys" in capsys.readouterr().err


def test_relay_flags_parse_and_survive_the_run_config_file(tmp_path):
    import json

    from fnrl.config import save_json
    from fnrl.experiments.math_grpo import parse_config
    cfg = parse_config(["--relay.num-relays", "2", "--relay.chunk-bytes", "1048576",
                        "--relay.ucx-error-handling"])
    assert (cfg.relay.num_relays, cfg.relay.chunk_bytes, cfg.relay.ucx_error_handling) == \
        (2, 2**20, True)
    save_json(cfg, tmp_path / "config.json")
    assert from_dict(RunConfig, json.loads((tmp_path / "config.json").read_text())) == cfg
    with pytest.raises(ValueError, match="RelayConfig.num_relays=0"):
        from_dict(RunConfig, {"relay": {"num_relays": 0}})


def test_registered_names_match_the_registries():
    """config is a leaf, so it keeps the registered names as tuples; they must not drift."""
    from fnrl import config
    from fnrl.losses import ADVANTAGES, LOSS_TERMS
    from fnrl.losses.aggregation import AGGREGATIONS
    from fnrl.losses.correction import CORRECTIONS
    from fnrl.losses.kl import KL_ESTIMATORS
    from fnrl.policy.samplers import SAMPLERS

    def builtin(registry):   # leaves out terms a test or a user registered (docs/losses.md)
        return sorted(k for k, fn in registry.items() if fn.__module__.startswith("fnrl."))

    for names, registry in [(config.LOSS_TERM_NAMES, LOSS_TERMS),
                            (config.ADVANTAGE_NAMES, ADVANTAGES),
                            (config.AGGREGATION_NAMES, AGGREGATIONS),
                            (config.KL_ESTIMATOR_NAMES, KL_ESTIMATORS),
                            (config.SAMPLER_NAMES, SAMPLERS)]:
        assert sorted(names) == builtin(registry)
    assert config.CORRECTION_NAMES == CORRECTIONS


def test_a_user_registered_loss_term_is_accepted():
    from fnrl.config import AlgoConfig, known_names
    from fnrl.losses import LOSS_TERMS, register

    with pytest.raises(ValueError, match="AlgoConfig.loss_terms='mine'"):
        AlgoConfig(loss_terms=(("mine", 1.0),))
    register(LOSS_TERMS, "mine")(lambda logp_BxT, batch: (0.0, {}))
    try:
        assert "mine" in known_names("loss_terms")
        assert AlgoConfig(loss_terms=(("mine", 1.0),)).loss_terms == (("mine", 1.0),)
    finally:
        LOSS_TERMS.pop("mine")


def test_moved_config_values_name_field_and_value():
    from fnrl.config import BalanceConfig, CostModel, FaultConfig, RepackConfig, RoutingConfig

    for build, match in [(lambda: CostModel(k5=0.0), "CostModel.k5=0.0"),
                         (lambda: RoutingConfig(phi_throughput=1.0), "RoutingConfig.phi_throughput=1.0"),
                         (lambda: RepackConfig(period_s=0.0), "RepackConfig.period_s=0.0"),
                         (lambda: BalanceConfig(max_moves=-1), "BalanceConfig.max_moves=-1"),
                         (lambda: FaultConfig(policy="node"), "FaultConfig.policy='node'")]:
        with pytest.raises(ValueError, match=match):
            build()


def test_gpu_needs_are_validated_and_parsed():
    from fnrl.config.run import RolloutConfig, TrainerConfig
    from fnrl.experiments.math_grpo import parse_config
    with pytest.raises(ValueError, match=r"RolloutConfig\.tensor_parallel_size=0"):
        RolloutConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"TrainerConfig\.gpus_per_process=-1"):
        TrainerConfig(gpus_per_process=-1)
    with pytest.raises(ValueError, match=r"TrainerConfig\.gpus_per_process=1\.5"):
        TrainerConfig(gpus_per_process=1.5)
    cfg = parse_config(["--rollout.tensor-parallel-size", "4", "--trainer.gpus-per-process", "2"])
    assert (cfg.rollout.tensor_parallel_size, cfg.trainer.gpus_per_process) == (4, 2)
    assert (RunConfig().rollout.tensor_parallel_size, RunConfig().trainer.gpus_per_process) == (1, 0)
