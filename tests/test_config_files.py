"""`--config FILE`: a run's config.json re-runs exactly, a partial YAML file overrides
the defaults and flags override the file, and bad keys or values name their path."""

import dataclasses
import json

import pytest

from fnrl.config import (AlgoConfig, CoordinatorConfig, RoutingConfig, RunConfig, TaskConfig,
                         TrainerConfig, save_json, to_dict)
from fnrl.config.files import nest, overlay, read_config_file
from fnrl.experiments.math_grpo import parse_config
from fnrl.config.presets import apply_preset


def odd_config() -> RunConfig:
    """A config far from the defaults in every kind of field: tuples of tuples, a
    Literal, an optional int, nested sections, a preset."""
    cfg = apply_preset("staleflow", RunConfig(
        steps=7, seed=3, run_dir="/somewhere/else",
        task=TaskConfig(num_eval=32, stop_tokens=("<a>", "<b>"), answer_format="boxed"),
        algo=AlgoConfig(loss_terms=(("ppo_clip", 1.0), ("aipo", 0.5)), learning_rate=3e-4,
                        top_k=5),
        trainer=TrainerConfig(length_buckets=(32, 64, 128), remat=True)))
    coord = dataclasses.replace(cfg.coord, eta=3,
                                routing=dataclasses.replace(cfg.coord.routing, max_routes=None))
    return dataclasses.replace(cfg, coord=coord)


def test_a_saved_config_json_parses_back_to_the_same_config(tmp_path):
    cfg = odd_config()
    save_json(cfg, tmp_path / "config.json")
    assert parse_config(["--config", str(tmp_path / "config.json")]) == cfg
    # The same file with a flag: the flag wins, nothing else moves.
    again = parse_config([f"--config={tmp_path / 'config.json'}", "--steps", "9"])
    assert again == dataclasses.replace(cfg, steps=9)


def test_a_run_directorys_config_json_reruns_in_a_new_directory(tmp_path):
    cfg = dataclasses.replace(odd_config(), run_dir=str(tmp_path))
    save_json(cfg, tmp_path / "config.json")
    (tmp_path / "run_info.json").write_text("{}")
    assert parse_config(["--config", str(tmp_path / "config.json")]).run_dir == ""
    assert parse_config(["--config", str(tmp_path / "config.json"), "--run-dir", "x"]).run_dir == "x"


def test_a_partial_yaml_file_overrides_the_preset_and_flags_override_the_file(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("preset: sync\nsteps: 3\nalgo.learning_rate: 1e-4\n"
                    "algo:\n  loss_terms: [[ppo_clip, 1], [aipo, 0.25]]\n"
                    "trainer.length-buckets: [32, 64]\ncoord.eta: 1\n")
    cfg = parse_config(["--config", str(path), "--steps", "5"])
    assert cfg.preset == "sync" and cfg.steps == 5          # the flag over the file
    assert cfg.algo.learning_rate == 1e-4                   # YAML 1.1 reads "1e-4" as text
    assert cfg.algo.loss_terms == (("ppo_clip", 1.0), ("aipo", 0.25))
    assert cfg.trainer.length_buckets == (32, 64)
    # The file's eta over its preset's; the rest of the coordinator is sync's.
    assert cfg.coord.eta == 1 and cfg.coord.routing == apply_preset("sync").coord.routing
    # Fields the file does not name keep the defaults.
    assert cfg.algo.group_size == RunConfig().algo.group_size
    assert cfg.algo.lr_schedule == RunConfig().algo.lr_schedule == "cosine"
    # A --preset flag sets the coordinator over the file's, as a preset does.
    flagged = parse_config(["--config", str(path), "--preset", "fnrl"])
    assert flagged.preset == "fnrl" and flagged.coord == apply_preset("fnrl").coord
    assert flagged.steps == 3


def test_a_file_without_a_preset_starts_from_the_default_preset(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 2\n")
    assert parse_config(["--config", str(tmp_path / "a.yaml")]) == \
        dataclasses.replace(parse_config([]), steps=2)
    (tmp_path / "empty.yaml").write_text("")
    assert parse_config(["--config", str(tmp_path / "empty.yaml")]) == parse_config([])


@pytest.mark.parametrize("text, message", [
    ("algo:\n  learnin_rate: 3\n", "unknown config key(s) algo.learnin_rate"),
    ("stepz: 3\n", "unknown config key(s) stepz"),
    ("rollout: {num_servers: two}\n", "rollout.num_servers='two': expected an integer"),
    ("steps: -1\n", "RunConfig.steps=-1"),
    ("coord.routing.mu: 2.0\n", "mu"),
    ("algo.loss_terms: [[ppo_clip]]\n", "algo.loss_terms[0]"),
    ("trainer.remat: 1\n", "trainer.remat=1: expected one of 'auto', 'none', 'dots', 'full'"),
    ("task.answer_format: latex\n", "task.answer_format='latex': expected one of"),
    ("algo: 3\n", "algo is a section"),
    ("preset: nope\n", "RunConfig.preset='nope'"),
    ("algo.learning_rate: fast\n", "algo.learning_rate='fast': expected a number"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("steps: 3\nsteps.x: 1\n", "steps"),
])
def test_bad_files_name_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        parse_config(["--config", str(path)])
    assert message in str(err.value) and "bad.yaml" in str(err.value)


def test_missing_and_unknown_kinds_of_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.yaml"):
        read_config_file(tmp_path / "nothere.yaml")
    (tmp_path / "c.toml").write_text("steps = 3")
    with pytest.raises(ValueError, match=r"\.json, \.yaml or \.yml"):
        read_config_file(tmp_path / "c.toml")
    (tmp_path / "c.json").write_text("{steps: 3")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config_file(tmp_path / "c.json")


def test_nest_expands_dotted_and_hyphenated_keys():
    assert nest({"algo.learning-rate": 1, "algo": {"group_size": 4}, "coord.routing.mu": 0.5}) \
        == {"algo": {"learning_rate": 1, "group_size": 4}, "coord": {"routing": {"mu": 0.5}}}
    with pytest.raises(ValueError, match="given twice"):
        nest({"algo.group_size": 4, "algo": {"group_size": 8}})


def test_overlay_changes_only_what_it_names():
    cfg = overlay(RunConfig(), {"coord": {"routing": {"sync": "lazy"}}, "seed": 4})
    assert cfg.coord.routing.sync == "lazy" and cfg.seed == 4
    assert to_dict(dataclasses.replace(cfg, seed=0, coord=CoordinatorConfig(
        routing=RoutingConfig()))) == to_dict(RunConfig())
    assert json.dumps(to_dict(cfg))   # still plain data


def test_the_file_wins_over_the_models_sampling_values_and_flags_over_both(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    path = tmp_path / "a.yaml"
    path.write_text(f"model.model_dir: {model}\nalgo.temperature: 0.9\n")
    algo = parse_config(["--config", str(path)]).algo
    assert (algo.temperature, algo.top_p, algo.top_k) == (0.9, 0.8, 20)
    algo = parse_config(["--config", str(path), "--algo.temperature", "0.5"]).algo
    assert (algo.temperature, algo.top_p, algo.top_k) == (0.5, 0.8, 20)
    # A run's config.json names every sampling value: the model's file changes none.
    cfg = parse_config(["--config", str(path)])
    save_json(cfg, tmp_path / "config.json")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert parse_config(["--config", str(tmp_path / "config.json")]) == cfg


def test_an_optional_section_is_off_as_absence_in_files_flags_and_config_json(tmp_path):
    """`coord.repack` / `coord.balance` are sections that are off when null: a preset turns
    one on, a file or a flag turns it on with fields or off, and config.json keeps it."""
    laminar = apply_preset("laminar")
    assert laminar.coord.repack is not None and laminar.coord.balance is None
    assert apply_preset("fnrl").coord.balance is not None
    save_json(laminar, tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["coord"]["balance"] is None
    assert parse_config(["--config", str(tmp_path / "config.json")]) == laminar
    # Flags in any order around the section's subcommand.
    cfg = parse_config(["--steps", "3", "coord.repack:off", "--coord.eta", "1",
                        "coord.balance:on", "--coord.balance.max-moves", "5"])
    assert cfg.coord.repack is None and cfg.coord.balance.max_moves == 5
    assert (cfg.steps, cfg.coord.eta) == (3, 1)
    path = tmp_path / "a.yaml"
    path.write_text("preset: sync\ncoord.repack: {c_max: 0.5}\n")
    assert parse_config(["--config", str(path)]).coord.repack.c_max == 0.5
    path.write_text("preset: laminar\ncoord.repack: null\n")
    assert parse_config(["--config", str(path)]).coord.repack is None
    path.write_text("preset: sync\ncoord.balance: 3\n")
    with pytest.raises(ValueError, match="coord.balance is a section"):
        parse_config(["--config", str(path)])


def test_old_switches_still_load_with_a_warning_naming_the_new_spelling(tmp_path, capsys):
    """fnrl.config.renamed: `use_repack` / `use_balance` in an old run's config.json, in a
    YAML file and as flags."""
    old = to_dict(apply_preset("laminar"))
    old["coord"] |= {"use_repack": True, "use_balance": False, "balance": {"threshold": 0.5,
                                                                           "max_moves": 64}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert parse_config(["--config", str(tmp_path / "config.json")]) == apply_preset("laminar")
    err = capsys.readouterr().err
    assert "coord.use_repack is deprecated; write coord.repack" in err
    assert "coord.use_balance is deprecated; write coord.balance" in err
    (tmp_path / "a.yaml").write_text("preset: sync\ncoord:\n  use_balance: true\n")
    assert parse_config(["--config", str(tmp_path / "a.yaml")]).coord.balance is not None
    cfg = parse_config(["--coord.use-repack", "--coord.no-use-balance"])
    assert cfg.coord.repack is not None and cfg.coord.balance is None
    err = capsys.readouterr().err
    assert "--coord.use-repack is deprecated; write coord.repack:on" in err
    assert "--coord.no-use-balance is deprecated; write coord.balance:off" in err


def test_moved_fields_still_load_from_old_files_and_flags(tmp_path, capsys):
    """Fields moved to where their concern lives (fnrl.config.renamed.MOVED) and the
    kills list that became the fault-injection section, in an old config.json and as
    old flags."""
    old = to_dict(RunConfig())
    old |= {"eval_every": 3, "trainer_timeout_s": 99.0}
    del old["eval"]["every"], old["trainer"]["call_timeout_s"], old["fsync_logs"]
    old["coord"]["pool_fsync"] = True
    old["rollout"] = {k: v for k, v in old["rollout"].items()
                      if k not in ("serve_dtype", "queued_groups")}
    old["rollout"] |= {"dtype": "bfloat16", "groups_per_batch": 3}
    old["faults"] |= {"inject": ["rollout0:at=2"], "seed": 5, "inject_bad_logprobs": 4,
                      "inject_noise": 1.0, "inject_corrupt_publish": 0,
                      "inject_logprob_shift": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = parse_config(["--config", str(tmp_path / "config.json")])
    assert (cfg.eval.every, cfg.trainer.call_timeout_s, cfg.fsync_logs) == (3, 99.0, True)
    assert cfg.faults.inject.kills == ("rollout0:at=2",)
    assert (cfg.faults.inject.seed, cfg.faults.inject.bad_logprobs) == (5, 4)
    assert (cfg.rollout.serve_dtype, cfg.rollout.queued_groups) == ("bfloat16", 3)
    err = capsys.readouterr().err
    for old_key, new_key in (("eval_every", "eval.every"), ("coord.pool_fsync", "fsync_logs"),
                             ("faults.inject", "faults.inject.kills"),
                             ("faults.inject_bad_logprobs", "faults.inject.bad_logprobs"),
                             ("rollout.dtype", "rollout.serve_dtype")):
        assert f"{old_key} is deprecated; write {new_key}" in err
    cfg = parse_config(["--eval-every=4", "--faults.inject", "relay0:at=3", "--coord.pool-fsync",
                        "--trainer-timeout-s", "7", "--rollout.groups-per-batch", "2"])
    assert (cfg.eval.every, cfg.trainer.call_timeout_s, cfg.fsync_logs) == (4, 7.0, True)
    assert cfg.rollout.queued_groups == 2
    assert cfg.faults.inject.kills == ("relay0:at=3",)
    assert "--eval-every is deprecated; write --eval.every" in capsys.readouterr().err
