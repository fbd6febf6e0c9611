"""A user's own what-if (issue 38): `python -m fnrl.sim compare`, a user's costs file merged
over costs.toml, workload presets, and the scale benchmark's η following its preset."""

from __future__ import annotations

import json

import pytest

from fnrl.sim import costs
from fnrl.sim.__main__ import CompareArgs, RunArgs, main, parse
from fnrl.sim.workload import WORKLOAD_PRESETS
from lab.benchmarks import sim_scale

# Eight H100s of the default model, a handful of short responses, two steps: seconds.
TINY = ["--gpus", "8", "--steps", "2", "--workload.groups-per-step", "4",
        "--workload.group-size", "2", "--workload.prompt-len", "32",
        "--workload.len-median", "64", "--workload.len-max", "128", "--no-plots"]


def test_compare_writes_table_markdown_plot_and_each_presets_eta(tmp_path, capsys):
    out = tmp_path / "cmp"
    result = main(["compare", "--presets", "fnrl,sync", "--out", str(out), *TINY])
    printed = capsys.readouterr().out
    rows = {r["preset"]: r for r in result["rows"]}
    # Each preset at its own η (fnrl.config.presets: fnrl 2, sync 0), and said so.
    assert (rows["fnrl"]["eta"], rows["sync"]["eta"]) == (2, 0)
    assert "fnrl ran at η = 2 (the preset's own)" in printed
    assert "sync ran at η = 0 (the preset's own)" in printed
    assert rows["sync"]["x_sync"] == pytest.approx(1.0)
    assert max(r["x_best"] for r in rows.values()) == pytest.approx(1.0)
    assert rows["fnrl"]["x_sync"] == pytest.approx(
        rows["fnrl"]["tokens_per_s"] / rows["sync"]["tokens_per_s"])
    for name in ("fnrl", "sync"):
        assert (out / name / "summary.json").is_file()
        assert json.loads((out / name / "summary.json").read_text())["eta"] == rows[name]["eta"]
    md = (out / "compare.md").read_text()
    assert "| fnrl | 2 |" in md and "| sync | 0 |" in md and "each preset at its own η" in md
    assert (out / "compare.png").stat().st_size > 0
    assert json.loads((out / "compare.json").read_text())["presets"] == ["fnrl", "sync"]
    assert "tokens/s" in printed and "interrupts/traj" in printed


def test_compare_pins_eta_when_given(tmp_path, capsys):
    result = main(["compare", "--presets", "sync", "fnrl", "--eta", "1",
                   "--out", str(tmp_path / "c"), *TINY])
    assert [(r["preset"], r["eta"], r["eta_pinned"]) for r in result["rows"]] == [
        ("sync", 1, True), ("fnrl", 1, True)]
    assert "fnrl ran at η = 1 (pinned by --eta)" in capsys.readouterr().out
    assert "every preset pinned at η = 1" in (tmp_path / "c" / "compare.md").read_text()


def test_compare_refuses_preset_flag_and_unknown_presets(tmp_path):
    with pytest.raises(ValueError, match="--presets"):
        main(["compare", "--preset", "sync", *TINY])
    with pytest.raises(ValueError, match="presets=.*'nope'"):
        main(["compare", "--presets", "fnrl,nope", "--out", str(tmp_path / "x"), *TINY])


def write(tmp_path, text: str):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


USER = """
[gpu.h100]
hbm_bytes = 94e9                # an H100 NVL: only the memory differs here

[model."my-3b"]
params = 3.1e9
active_params = 3.1e9
layers = 36
attn_dim = 2048
kv_bytes_per_token = 36864      # 2*36*2*128*2
"""


def test_user_costs_add_a_model_and_override_a_gpu(tmp_path):
    path = write(tmp_path, USER)
    table = costs.load_table(user=path)
    assert costs.model_spec("my-3b", table).params == 3.1e9
    h100, builtin = costs.gpu_spec("h100", table), costs.gpu_spec("h100")
    assert h100.hbm_bytes == 94e9 and builtin.hbm_bytes == 80e9
    # Fields the user's file leaves out keep the built-in values; other entries stay.
    assert (h100.peak_flops, h100.hbm_bw) == (builtin.peak_flops, builtin.hbm_bw)
    assert costs.model_spec("qwen2.5-7b", table) == costs.model_spec("qwen2.5-7b")
    # The command line runs on it, and the run directory keeps the merged tables.
    out = tmp_path / "run"
    summary = main(["--costs", str(path), "--cluster.model", "my-3b", "--out", str(out), *TINY])
    assert summary["steps"] == 2
    saved = json.loads((out / "costs.json").read_text())
    assert saved["gpu"]["h100"]["hbm_bytes"] == 94e9 and "my-3b" in saved["model"]


@pytest.mark.parametrize("text, key, why", [
    ("[gpu.h200]\npeak_flops = 989e12\nhbm_bytes = 141e9\n", 'gpu."h200"', "hbm_bw"),
    ('[gpu.h100]\nhbm_bw = "fast"\n', 'gpu."h100"', "fast"),
    ("[model.qwen3-30b-a3b]\nparams = -1.0\n", 'model."qwen3-30b-a3b"', "params"),
    ("[model.x]\nparam = 1.0\n", 'model."x"', "param"),
    ("[roofline]\ndecode_mfu = 0\n", "roofline", "decode_mfu"),
    ("[gpus.h200]\npeak_flops = 1.0\n", "gpus", "unknown section"),
    ("[gpu.h100\n", "", "line 1"),
])
def test_malformed_user_costs_are_refused_naming_file_and_key(tmp_path, text, key, why):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        costs.load_table(user=path)
    message = str(err.value)
    assert str(path) in message and key in message and why in message


def test_workload_preset_is_applied_and_a_flag_overrides_its_field():
    gsm8k = WORKLOAD_PRESETS["gsm8k"]
    assert parse(RunArgs, ["--workload-preset", "gsm8k"]).sim.workload == gsm8k
    # The flag wins wherever it stands; the preset's other fields stay.
    for argv in (["--workload-preset", "gsm8k", "--workload.len-max", "2048"],
                 ["--workload.len-max", "2048", "--workload-preset", "gsm8k"]):
        w = parse(CompareArgs, argv).sim.workload
        assert (w.len_max, w.len_median, w.group_size) == (2048, gsm8k.len_median, gsm8k.group_size)
    assert parse(RunArgs, []).sim.workload.len_median == 4096   # no preset: WorkloadSpec's own
    with pytest.raises(SystemExit):
        parse(RunArgs, ["--workload-preset", "nope"])


def test_sim_scale_eta_follows_the_preset_unless_given():
    def eta(*argv):
        return sim_scale.eta_used(sim_scale.scale_config(sim_scale.parse_args(list(argv))))

    assert sim_scale.parse_args([]).eta == -1
    assert (eta("--preset", "sync"), eta(), eta("--preset", "laminar")) == (0, 2, 4)
    assert eta("--preset", "sync", "--eta", "3") == 3
    assert eta("--eta", "3", "--ablate", "eta") == 1    # one_step's bound, as the run holds it
