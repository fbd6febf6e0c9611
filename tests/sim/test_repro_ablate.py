"""fnrl.sim.repro.ablate: each ablation changes the coordinator the simulation runs, the
table's arithmetic, and a quick run of the scale setup."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fnrl.sim.cluster import layout, plan_for
from fnrl.sim.config import ABLATIONS
from fnrl.sim.repro import SETUPS, Setup
from fnrl.sim.repro import ablate as ab
from fnrl.sim.repro import scale

FNRL = scale.scale(True).runs["fnrl"]      # η = 3


def _cycle(cfg, *names):
    cfg = dataclasses.replace(cfg, ablate=names)
    return plan_for(cfg, layout(cfg).decode).cycle


def test_each_ablation_changes_the_coordinator_the_simulation_runs():
    full = _cycle(FNRL)
    assert (full.repack, full.balance) != (None, None)
    assert (full.routing.migrate, full.routing.sync, full.sampler, full.staleness.eta) == \
        (True, "lazy", "fifo", 3)
    changed = {
        "repack": lambda c: c.repack is None,
        "balance": lambda c: c.balance is None,
        "migration": lambda c: c.routing.migrate is False,
        "lazy_sync": lambda c: c.routing.sync == "greedy",
        "sampler": lambda c: c.sampler == "protocol",
        "eta": lambda c: c.staleness.eta == 1,
    }
    assert sorted(changed) == sorted(ABLATIONS)
    for name in ABLATIONS:
        off = _cycle(FNRL, name)
        assert off != full and changed[name](off), name
        # Only that field: switching it back on gives full fnrl's config.
        others = [n for n in ABLATIONS if n != name]
        assert not any(changed[n](off) for n in others), name
    everything = _cycle(FNRL, *ABLATIONS)
    assert all(check(everything) for check in changed.values())


def test_ablations_a_preset_lacks_change_nothing():
    for preset, name in [("staleflow", "repack"), ("staleflow", "balance"),
                         ("laminar", "lazy_sync"), ("laminar", "migration")]:
        cfg = dataclasses.replace(FNRL, preset=preset, eta=-1)
        assert _cycle(cfg, name) == _cycle(cfg), (preset, name)
    sync = dataclasses.replace(FNRL, preset="sync", eta=-1)
    assert _cycle(sync, "eta").staleness.eta == 0     # η = 0 stays 0, never loosened


def test_table_arithmetic_and_reuse_of_equal_configs(monkeypatch, tmp_path):
    """A setup whose "fnrl" run is the staleflow preset (η = 1): repack, balance and η
    leave its coordinator as it is, so they are not run again; Δ is the median of the
    per-seed ratios."""
    base = dataclasses.replace(FNRL, preset="staleflow", eta=-1)
    monkeypatch.setitem(SETUPS, "t-staleflow", lambda quick: Setup(
        paper="test", setup="", runs={"fnrl": base}))
    calls = []

    def fake_run(cfg):
        calls.append((cfg.ablate, cfg.seed))
        rate = {0: 100.0, 1: 200.0, 2: 400.0}[cfg.seed] * (0.5 if "migration" in cfg.ablate else 1.0)
        counts = {k: 2 * cfg.seed for k in ab.COUNTS}
        return {ab.METRIC: rate * (1 + 0.1 * cfg.seed * ("sampler" in cfg.ablate)), **counts,
                "staleness_mean": 0.5, "rollout_idle_frac": 0.1, "trainer_idle_frac": 0.2}

    monkeypatch.setattr(ab, "run_once", fake_run)
    res = ab.ablate("t-staleflow", seeds=(0, 1, 2), out=tmp_path, log=lambda _: None)
    ran = {names for names, _ in calls}
    assert not {("repack",), ("balance",), ("eta",)} & ran and len(calls) == 3 * 5
    rows = {r["variant"]: r for r in res["rows"]}
    assert [r["variant"] for r in res["rows"]] == ["fnrl", *ABLATIONS, "all"]
    assert [r["variant"] for r in res["rows"] if r["same_config"]] == ["repack", "balance", "eta"]
    assert rows["repack"]["per_seed"] == rows["fnrl"]["per_seed"] == [100.0, 200.0, 400.0]
    assert rows["migration"]["delta"] == pytest.approx(-0.5)
    assert rows["eta"]["delta"] == 0.0
    # Per-seed ratios 1.0, 1.1, 1.2: the median change is +10%.
    assert rows["sampler"]["delta"] == pytest.approx(0.1)
    assert (rows["sampler"]["median"], rows["sampler"]["min"]) == (pytest.approx(220.0), 100.0)
    assert rows["fnrl"]["interrupted"] == 2
    md = (tmp_path / "t-staleflow" / "ablation.md").read_text()
    assert "(same config)" in md and "+10.0%" in md and "-50.0%" in md
    saved = json.loads((tmp_path / "t-staleflow" / "ablation.json").read_text())
    assert saved["rows"][0]["per_seed"] == [100.0, 200.0, 400.0]
    assert (tmp_path / "t-staleflow" / "ablation.png").stat().st_size > 0


def test_quick_scale_ablation(tmp_path):
    res = ab.ablate("scale", seeds=(0,), quick=True, out=tmp_path, log=lambda _: None)
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["fnrl", *ABLATIONS, "all"]
    assert not any(r["same_config"] for r in rows.values())
    assert all(r["median"] > 0 for r in rows.values())
    assert rows["fnrl"]["delta"] == 0.0
    # With both repack and migration off, nothing issues a Migrate.
    assert rows["all"]["repacks"] == rows["all"]["migrated"] == 0
    assert rows["fnrl"]["repacks"] > 0
    eta1 = res["summaries"]["eta"][0]
    assert eta1["eta"] == 1 and eta1["staleness_checked_max"] <= 1
    assert res["summaries"]["fnrl"][0]["eta"] == 3
    for ext in ("md", "json", "png"):
        assert (tmp_path / "scale" / f"ablation.{ext}").exists()


def test_importing_ablate_registers_no_setup_and_bad_setups_fail(monkeypatch):
    assert "ablate" not in SETUPS
    with pytest.raises(ValueError, match="no setup 'nope'"):
        ab.ablate("nope", seeds=(0,), quick=True)
    monkeypatch.setitem(SETUPS, "t-nofnrl", lambda quick: Setup(paper="test", setup="",
                                                                runs={"sync": FNRL}))
    with pytest.raises(ValueError, match="no simulated run labelled 'fnrl'"):
        ab.ablate("t-nofnrl", seeds=(0,), quick=True)
