"""lab.repro's bookkeeping on stub systems: a claim's ratio within each seed, the
median and spread over seeds, the error against the paper and the goal's verdict."""

import json

import pytest

from lab import repro
from lab.repro import Claim, Setup


def _stub(tokens_per_s: dict[int, float], step_s: dict[int, float]):
    return lambda seed: {"trained_seq_tokens_per_s": tokens_per_s[seed], "step_s": step_s[seed]}


@pytest.fixture
def setup(monkeypatch):
    s = Setup(paper="stub", setup="two systems",
              runs={"a": _stub({0: 300.0, 1: 240.0, 2: 330.0}, {0: 10.0, 1: 12.0, 2: 9.0}),
                    "b": _stub({0: 100.0, 1: 100.0, 2: 100.0}, {0: 20.0, 1: 30.0, 2: 18.0})},
              claims=(Claim(name="a/b", system="a", baseline="b", paper=2.5),
                      Claim(name="step", system="a", baseline="b", paper=2.0,
                            metric="step_s", lower_is_better=True, tolerance=0.15)))
    monkeypatch.setitem(repro.SETUPS, "stub", lambda quick: s)
    return s


def test_ratios_are_taken_within_a_seed_and_summarised_over_seeds(setup, tmp_path):
    res = repro.reproduce("stub", seeds=(0, 1, 2), out=tmp_path, log=lambda _: None)
    tput, step = res.rows()
    assert tput["per_seed"] == [3.0, 2.4, 3.3]
    assert (tput["simulated"], tput["min"], tput["max"]) == (3.0, 2.4, 3.3)
    assert tput["error"] == pytest.approx(0.2) and tput["within"]        # +20%: on the edge
    assert step["per_seed"] == [2.0, 2.5, 2.0]                           # baseline / system
    assert step["simulated"] == 2.0 and step["within"]
    written = json.loads((tmp_path / "stub" / "repro.json").read_text())
    assert [r["claim"] for r in written["rows"]] == ["a/b", "step"]
    assert (tmp_path / "stub" / "repro.png").stat().st_size > 0
    table = (tmp_path / "stub" / "repro.md").read_text()
    assert "| a/b | 2.50× | 3.00× (2.40–3.30) | +20% | yes (±20%) |" in table


def test_a_figure_outside_the_goal_says_no(setup):
    res = repro.reproduce("stub", seeds=(1,), log=lambda _: None)
    tput, step = res.rows()
    assert tput["error"] == pytest.approx(-0.04) and tput["within"]
    assert step["error"] == pytest.approx(0.25) and not step["within"]   # 2.5 against 2.0 ± 15%
    assert "no (±15%)" in res.table()


def test_an_unknown_setup_is_named():
    with pytest.raises(ValueError, match="no setup 'nope'"):
        repro.reproduce("nope")


def test_a_gain_the_simulation_does_not_show_is_a_miss_however_close(monkeypatch):
    """StaleFlow vs VeRL-Async: 0.98× where the paper has 1.17× is within ±20% in size
    but says the other thing (no gain), so it is not a hit."""
    s = Setup(paper="stub", setup="a paper's gain, simulated as none",
              runs={"a": _stub({0: 98.0}, {0: 1.0}), "b": _stub({0: 100.0}, {0: 1.0})},
              claims=(Claim(name="a/b", system="a", baseline="b", paper=1.17),))
    monkeypatch.setitem(repro.SETUPS, "stub", lambda quick: s)
    res = repro.reproduce("stub", seeds=(0,), log=lambda _: None)
    (row,) = res.rows()
    assert abs(row["error"]) <= row["tolerance"] and not row["same_direction"]
    assert not row["within"]
    assert "no (±20%, the other direction)" in res.table()
