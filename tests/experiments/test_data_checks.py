"""Bad input is reported before any role starts: no server, relay or trainer is spawned
for a job whose data or model directory cannot be used."""

from __future__ import annotations

import json

import pytest

from fnrl.experiments import math_grpo


@pytest.fixture
def no_roles(monkeypatch):
    """Fails the test if the job gets as far as starting roles."""
    class Refused:
        def __init__(self, *a, **kw):
            raise AssertionError("a role was started before the input was checked")
    monkeypatch.setattr(math_grpo, "Cluster", Refused)


def _main(tmp_path, model_dir, *flags):
    return math_grpo.main(["--model.model-dir", str(model_dir), "--run-dir", str(tmp_path / "run"),
                           "--steps", "1", "--algo.max-new-tokens", "8", *flags])


def test_a_missing_dataset_file_is_named_before_any_role_starts(tmp_path, tiny_model_dir,
                                                                no_roles, capsys):
    missing = tmp_path / "nowhere.jsonl"
    assert _main(tmp_path, tiny_model_dir, "--task.dataset", str(missing)) == 2
    assert "task.dataset" in capsys.readouterr().err


def test_a_bad_row_under_on_bad_row_error_is_named_before_any_role_starts(
        tmp_path, tiny_model_dir, no_roles, capsys):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    lines = [json.dumps(r) for r in rows]
    lines[6] = '{"prompt": "7+1=", "answer": '          # truncated JSON on line 7
    data.write_text("\n".join(lines) + "\n")
    assert _main(tmp_path, tiny_model_dir, "--task.dataset", str(data), "--task.num-eval", "4",
                 "--task.on-bad-row", "error") == 2
    err = capsys.readouterr().err
    assert "row 7" in err and str(data) in err


def test_a_response_limit_beyond_the_context_is_named_before_any_role_starts(
        tmp_path, tiny_model_dir, no_roles, capsys):
    assert _main(tmp_path, tiny_model_dir, "--algo.max-new-tokens", "64") == 2
    assert "algo.max_new_tokens=64 leaves no room" in capsys.readouterr().err


def test_a_model_dir_without_weights_is_named_before_any_role_starts(tmp_path, tiny_model_dir,
                                                                     no_roles, capsys):
    broken = tmp_path / "model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert _main(tmp_path, broken) == 2
    assert "safetensors" in capsys.readouterr().err
