"""The benchmarks' rounds module (lab/benchmarks/rounds.py): the host's environment line, and
the shared method (lab.ablation.rounds, tested in tests/lab/ablation/test_round_method.py)
re-exported for the benchmark scripts."""

from lab.benchmarks import rounds

from lab.ablation import rounds as shared


def test_the_scripts_get_the_one_shared_method():
    assert rounds.round_orders is shared.round_orders and rounds.Spread is shared.Spread
    assert rounds.ratios_agree is shared.ratios_agree


def test_environment_names_cpus_memory_and_versions():
    line = rounds.environment()
    assert "CPUs" in line and "MemAvailable" in line and "numpy" in line
