"""The main job on a relay tier of two: the trainer publishes to the master only, the
chain carries every version to the second relay, and each rollout pulls from its own;
a killed relay is replaced and its rollout pulls from the replacement. One run asserts
all of it, and that a clean run (as far as training goes) fires no correctness gate
(tests/experiments/test_gates_runs.py has the runs where each gate must fire)."""

import json
import re

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main

from tests.experiments.e2e_args import SMALL

pytestmark = pytest.mark.slow

def loaded_versions(log: str) -> list[tuple[int, str]]:
    """(version, relay address) of every version the rollout's worker loaded."""
    return [(int(v), a) for v, a in re.findall(r"fnrl_pull: version (\d+) from relay (\S+)", log)]


def visible_versions(log: str) -> set[int]:
    return {int(v) for v in re.findall(r"version (\d+) visible", log)}


def test_the_tier_carries_every_version_through_a_relay_kill_and_no_gate_fires(tmp_path,
                                                                                cache_dir):
    run_dir = tmp_path / "run"
    steps = 8
    # relay1, rollout 1's home, is SIGKILLed in step 2; the supervisor starts another on
    # its node (this host), which joins the chain and serves once it has caught up.
    assert main(["--steps", str(steps), "--eval.every", "4", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, "--rollout.num-servers", "2",
                 "--relay.num-relays", "2", "--faults.inject.kills", "relay1:at=2", *SMALL]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # No gate fired: a relay's death costs no training step and skews no log-prob.
    assert [r for r in records if r["kind"] == "gate"] == []
    assert all(r["gate_refused"] == 0.0 for r in train)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["gate_firings"] == 0 and summary["gate_stopped"] is None
    assert not (run_dir / "gates_stop.json").exists()

    faults = read_jsonl(run_dir / "faults.jsonl")
    (repair,) = [f for f in faults if f["event"] == "chain_repaired"]
    assert (repair["role"], repair["cause"]) == ("relay1", "exited")
    (recovered,) = [f for f in faults if f["event"] == "recovered"]
    assert recovered["role"] == "relay1" and recovered["t"] >= repair["t"]
    roles = json.loads((run_dir / "roles.json").read_text())
    relay0, replacement = roles["relay0"]["address"], roles["relay1"]["address"]
    assert recovered["address"] == replacement
    logs = run_dir / "logs"
    visible = [visible_versions((logs / f"relay{i}.log").read_text()) for i in range(2)]
    # Rollout 0 pulled from its own relay, the master, alone; every version it loaded was
    # visible there.
    loads0 = loaded_versions((logs / "rollout0.log").read_text())
    assert loads0 and max(v for v, _ in loads0) >= 1, "rollout0 never loaded a new version"
    assert {a for _, a in loads0} == {relay0} and {v for v, _ in loads0} <= visible[0]
    # Before the kill rollout 1 pulled from the first relay1, meanwhile from relay0, and
    # after the join from the replacement (a new address: every such pull came after it),
    # never a version older than the one the replacement held when it began to serve.
    loads = loaded_versions((logs / "rollout1.log").read_text())
    assert loads[0][1] not in (replacement, relay0)
    assert {a for _, a in loads} <= {loads[0][1], relay0, replacement}
    after = [v for v, a in loads if a == replacement]
    assert after, f"rollout1 never pulled from the replacement: {loads}"
    assert min(after) >= recovered["version"]
    # Relay1 (each of them) got versions by the chain only: the trainer publishes to the
    # master, and what rollout 1 loaded from a relay1 was visible there.
    assert {v for v, a in loads if a != relay0} <= visible[1]
    # The master held every version but perhaps the last (the job may end while it is in
    # flight); the replacement, every one from where it began to serve.
    assert set(range(steps)) <= visible[0], visible
    assert set(range(recovered["version"], steps)) <= visible[1], visible
