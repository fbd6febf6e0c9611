"""The benchmarks' rounds module (benchmarks/rounds.py): the host's environment line, and
the shared method (fnrl.experiments.rounds, tested in tests/experiments/test_round_method.py)
re-exported for the benchmark scripts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rounds  # noqa: E402

from fnrl.experiments import rounds as shared  # noqa: E402


def test_the_scripts_get_the_one_shared_method():
    assert rounds.round_orders is shared.round_orders and rounds.Spread is shared.Spread
    assert rounds.ratios_agree is shared.ratios_agree


def test_environment_names_cpus_memory_and_versions():
    line = rounds.environment()
    assert "CPUs" in line and "MemAvailable" in line and "numpy" in line
