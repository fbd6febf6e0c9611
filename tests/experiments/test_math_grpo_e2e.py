"""The main job end to end: real vLLM server, real relay process, real trainer process."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main

from tests.experiments.e2e_args import SMALL

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("preset,lora", [("laminar", 0), ("sync", 8)])
def test_short_run_serves_new_versions_and_ships_per_token_versions(tmp_path, cache_dir, preset,
                                                                     lora):
    """The sync run trains LoRA adapters (rank 8): the same checks hold with adapter-only
    versions merged on the rollout (on a fresh version vLLM's log-probs are the trainer's),
    and its export is checked too."""
    run_dir = tmp_path / "run"
    assert main(["--preset", preset, "--steps", "3", "--eval.every", "2", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, "--trainer.lora.rank", str(lora),
                 # An entropy bonus moves the adapters even when every reward is equal
                 # (the small model's usually are: GRPO's advantages are then zero).
                 *(["--algo.entropy-coef", "0.01"] if lora else []), *SMALL]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # The rollout served versions newer than the one it started with, reported by the
    # worker extension after each pull (evaluation runs on whatever version it serves).
    assert max(max(r["rollout_versions"]) for r in train) >= 1
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 3
    for r in train:
        assert sum(r["staleness_hist"]) == r["tokens"] > 0  # every trained token has a version
        assert r["staleness_max"] <= 4
    # Behaviour log-probs from vLLM reached the trainer: on a fresh version (staleness 0)
    # they match the trainer's own log-probs (zeros or garbage would differ by ~1 nat).
    # The strict 1e-3 float32 parity is tests/trainer/test_vllm_logprob_parity.py; here one
    # post-pull step has been seen at 3.5e-3 (open question, noted on issue 5).
    fresh = [r for r in train if r["staleness_max"] == 0]
    assert fresh and all(r["logp_abs_diff"] < 1e-2 for r in fresh)
    if preset == "sync":
        assert all(r["staleness_max"] == 0 for r in train)
    for name in ("config.json", "run_info.json", "curves.png", "summary.json", "timeline.png",
                 "trajectories.jsonl", "partial_responses.log"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").iterdir())
    assert json.loads((run_dir / "run_info.json").read_text())["code"]["commit"]
    assert json.loads((run_dir / "config.json").read_text())["preset"] == preset
    if lora:
        check_lora_run(run_dir, train)


def check_lora_run(run_dir, train):
    """Adapter-only versions: published, merged by the rollout, checkpointed and exported."""
    from safetensors.numpy import load_file

    from fnrl.experiments.export import export
    from fnrl.models.hf_io import load_pretrained, params_to_hf

    published = {r["publish_bytes"] for r in train}
    assert len(published) == 1
    out = export(run_dir, tmp := run_dir / "export", version=3)
    assert out == tmp
    base_dir = json.loads((out / "export.json").read_text())["base_model"]
    base_cfg, _, base = load_pretrained(base_dir)
    full_bytes = sum(v.nbytes for v in params_to_hf(base_cfg, base).values())
    # Adapters alone (and a scale), not the model: rank 8 of a 64-wide model is 1/5 of it.
    assert published.pop() < full_bytes / 4
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA" and len(adapter) == (
        2 * 7 * base_cfg.num_hidden_layers)
    # The merged model is the base plus scaling · B·A of the exported adapter (PEFT's rule).
    merged = params_to_hf(base_cfg, load_pretrained(out / "model")[2])
    base_hf = params_to_hf(base_cfg, base)
    name = "model.layers.1.mlp.down_proj"
    delta = config["lora_alpha"] / config["r"] * (
        adapter[f"base_model.model.{name}.lora_B.weight"]
        @ adapter[f"base_model.model.{name}.lora_A.weight"])
    assert abs(delta).max() > 0
    np.testing.assert_allclose(merged[name + ".weight"], base_hf[name + ".weight"] + delta,
                               rtol=1e-5, atol=1e-6)
    assert (out / "model" / "tokenizer.json").exists()
    # Checkpoints hold the adapters' state (and their moments), not the model's.
    import jax
    import orbax.checkpoint as ocp
    saved = ocp.StandardCheckpointer().metadata(run_dir / "checkpoints" / "3" / "state")
    names = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(saved.item_metadata)[0]]
    params = [n for n in names if n.startswith("['params']")]
    assert len(params) == 2 * 7 * base_cfg.num_hidden_layers
    assert all("_lora_" in n for n in params) and not any("embedding" in n for n in names)


def test_a_failure_the_job_may_not_survive_ends_it_with_the_error(tmp_path, cache_dir):
    # With no job restarts allowed and every failure escalated to the job, a killed
    # trainer ends the run with its error (tests/experiments/test_faults_e2e.py has the
    # runs that survive).
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnrl.experiments.math_grpo", "--steps", "1000", "--run-dir",
         str(run_dir), "--warm-start.cache-dir", cache_dir, "--faults.policy", "job",
         "--faults.max-job-restarts", "0", *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "metrics.jsonl").exists() or '"train"' not in (
                run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        roles = json.loads((run_dir / "roles.json").read_text())
        os.kill(roles["trainer"]["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert ("gave up after 0 job restart(s): trainer process was killed by SIGKILL from "
                "outside fnrl") in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_journal_damaged_in_the_middle_stops_the_resume_before_any_role_starts(
        tmp_path, cache_dir, capsys):
    from fnrl.shell.records import frame

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [frame({"ev": "fill", "problem": {"uid": f"p{i}"}, "uids": [], "lens": []})
             for i in range(3)]
    lines[1] = "this is not a record\n"
    (run_dir / "journal.jsonl").write_text("".join(lines))
    assert main(["--steps", "2", "--run-dir", str(run_dir), "--warm-start.cache-dir",
                 cache_dir, *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"byte {len(lines[0])}" in err and "journal.jsonl" in err and "record 1" in err
    assert not (run_dir / "roles.json").exists() and not (run_dir / "logs").exists()
    assert (run_dir / "journal.jsonl").read_text() == "".join(lines)
