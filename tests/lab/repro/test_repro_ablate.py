"""lab.repro.ablate: each ablation changes the coordinator the simulation runs, the
table's arithmetic, and a quick run of the scale setup."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fnrl.sim.coordinator import plan_for
from fnrl.sim.layout import layout
from fnrl.sim.config import ABLATIONS
from lab.repro import SETUPS, Setup
from lab.repro import ablate as ab
from lab.repro import scale

FNRL = scale.scale(True).runs["fnrl"]      # η = 3


def _cycle(cfg, *names, enable=()):
    cfg = dataclasses.replace(cfg, ablate=names, enable=enable)
    return plan_for(cfg, layout(cfg).decode).cycle


def test_each_ablation_changes_the_coordinator_the_simulation_runs():
    """Each mechanism the preset runs, off alone, changes only its own field; repack, which
    the preset leaves out, is switched on instead."""
    full = _cycle(FNRL)
    assert full.repack is None and full.balance is not None
    assert (full.routing.migrate, full.routing.sync, full.sampler, full.staleness.eta) == \
        (True, "lazy", "fifo", 3)
    changed = {
        "repack": lambda c: c.repack is None,
        "balance": lambda c: c.balance is None,
        "migration": lambda c: c.routing.migrate is False,
        "lazy_sync": lambda c: c.routing.sync == "greedy",
        "routing": lambda c: c.routing.policy == "fewest",
        "sampler": lambda c: c.sampler == "protocol",
        "eta": lambda c: c.staleness.eta == 1,
    }
    assert sorted(changed) == sorted(ABLATIONS)
    for name in ABLATIONS:
        off = _cycle(FNRL, name)
        others = [n for n in ABLATIONS if n != name]
        if name == "repack":
            assert off == full
            on = _cycle(FNRL, enable=(name,))
            assert on.repack is not None and not any(changed[n](on) for n in others)
            continue
        assert off != full and changed[name](off) and off.repack is None, name
        # Only that field: switching it back on gives full fnrl's config.
        assert not any(changed[n](off) for n in others if n != "repack"), name
    everything = _cycle(FNRL, *ABLATIONS)
    assert all(check(everything) for check in changed.values())
    labels = [label for label, _ in ab.variants(FNRL)]
    assert labels == ["fnrl", "+repack", "balance", "migration", "lazy_sync", "routing", "sampler",
                      "eta", "all"]


def test_ablations_a_preset_lacks_change_nothing():
    for preset, name in [("staleflow", "repack"), ("staleflow", "balance"),
                         ("laminar", "lazy_sync"), ("laminar", "migration")]:
        cfg = dataclasses.replace(FNRL, preset=preset, eta=-1)
        assert _cycle(cfg, name) == _cycle(cfg), (preset, name)
    sync = dataclasses.replace(FNRL, preset="sync", eta=-1)
    assert _cycle(sync, "eta").staleness.eta == 0     # η = 0 stays 0, never loosened


def test_table_arithmetic_and_reuse_of_equal_configs(monkeypatch, tmp_path):
    """A setup whose "fnrl" run is the staleflow preset (η = 1): it has no repack and no
    balancer, so those rows switch them on ("+repack", "+balance"); η → 1 leaves its
    coordinator as it is, so it is not run again; Δ is the median of the per-seed ratios."""
    base = dataclasses.replace(FNRL, preset="staleflow", eta=-1)
    monkeypatch.setitem(SETUPS, "t-staleflow", lambda quick: Setup(
        paper="test", setup="", runs={"fnrl": base}))
    calls = []

    def fake_run(cfg):
        calls.append((cfg.ablate + tuple(f"+{n}" for n in cfg.enable), cfg.seed))
        rate = {0: 100.0, 1: 200.0, 2: 400.0}[cfg.seed] * (0.5 if "migration" in cfg.ablate else 1.0)
        rate *= 1.25 if "repack" in cfg.enable else 1.0
        counts = {k: 2 * cfg.seed for k in ab.COUNTS}
        return {ab.METRIC: rate * (1 + 0.1 * cfg.seed * ("sampler" in cfg.ablate)), **counts,
                "staleness_mean": 0.5, "rollout_idle_frac": 0.1, "trainer_idle_frac": 0.2}

    monkeypatch.setattr(ab, "run_once", fake_run)
    res = ab.ablate("t-staleflow", seeds=(0, 1, 2), out=tmp_path, log=lambda _: None)
    ran = {names for names, _ in calls}
    assert ("eta",) not in ran and {("+repack",), ("+balance",)} <= ran and len(calls) == 3 * 8
    rows = {r["variant"]: r for r in res["rows"]}
    assert [r["variant"] for r in res["rows"]] == ["fnrl", "+repack", "+balance", "migration",
                                                  "lazy_sync", "routing", "sampler", "eta", "all"]
    assert [r["variant"] for r in res["rows"] if r["same_config"]] == ["eta"]
    assert rows["eta"]["per_seed"] == rows["fnrl"]["per_seed"] == [100.0, 200.0, 400.0]
    assert rows["+repack"]["delta"] == pytest.approx(0.25)
    assert rows["+repack"]["off"].startswith("switched on: Laminar's repack")
    assert rows["migration"]["delta"] == pytest.approx(-0.5)
    assert rows["eta"]["delta"] == 0.0
    # Per-seed ratios 1.0, 1.1, 1.2: the median change is +10%.
    assert rows["sampler"]["delta"] == pytest.approx(0.1)
    assert (rows["sampler"]["median"], rows["sampler"]["min"]) == (pytest.approx(220.0), 100.0)
    assert rows["fnrl"]["interrupted"] == 2
    md = (tmp_path / "t-staleflow" / "ablation.md").read_text()
    assert "(same config)" in md and "+10.0%" in md and "-50.0%" in md and "+25.0%" in md
    saved = json.loads((tmp_path / "t-staleflow" / "ablation.json").read_text())
    assert saved["rows"][0]["per_seed"] == [100.0, 200.0, 400.0]
    assert (tmp_path / "t-staleflow" / "ablation.png").stat().st_size > 0


def test_quick_scale_ablation(tmp_path):
    res = ab.ablate("scale", seeds=(0,), quick=True, out=tmp_path, log=lambda _: None)
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["fnrl", "+repack", *ABLATIONS[1:], "all"]
    assert not any(r["same_config"] for r in rows.values())
    assert all(r["median"] > 0 for r in rows.values())
    assert rows["fnrl"]["delta"] == 0.0
    # Repack moves trajectories only where it is switched on (its Migrates are counted
    # apart from balancing's); with migration off too, nothing issues a Migrate.
    repacks = {v: res["summaries"][v][0]["repacks"] for v in ("fnrl", "+repack")}
    assert repacks["fnrl"] == 0 < repacks["+repack"] <= rows["+repack"]["migrations"]
    assert rows["all"]["migrations"] == rows["all"]["migrated"] == 0
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
