"""The main job on a relay tier of two: the trainer publishes to the master only, the
chain carries every version to the second relay, and each rollout pulls from its own."""

import json
import re

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main

from e2e_args import SMALL

pytestmark = pytest.mark.slow

def loaded_versions(log: str) -> list[tuple[int, str]]:
    """(version, relay address) of every version the rollout's worker loaded."""
    return [(int(v), a) for v, a in re.findall(r"fnrl_pull: version (\d+) from relay (\S+)", log)]


def visible_versions(log: str) -> set[int]:
    return {int(v) for v in re.findall(r"version (\d+) visible", log)}


def test_each_rollout_pulls_from_its_own_relay(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    assert main(["--steps", "3", "--eval-every", "2", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, "--rollout.num-servers", "2",
                 "--relay.num-relays", "2", *SMALL]) == 0
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    roles = json.loads((run_dir / "roles.json").read_text())
    relays = [roles[f"relay{i}"]["address"] for i in range(2)]
    logs = run_dir / "logs"
    for i in range(2):
        loads = loaded_versions((logs / f"rollout{i}.log").read_text())
        assert loads and max(v for v, _ in loads) >= 1, f"rollout{i} never loaded a new version"
        assert {a for _, a in loads} == {relays[i]}, f"rollout{i} pulled from {loads}"
        # What rollout i loaded was visible at its relay; relay1 gets versions only by the
        # chain (the trainer publishes to the master, relay0).
        assert {v for v, _ in loads} <= visible_versions((logs / f"relay{i}.log").read_text())
    reached = [visible_versions((logs / f"relay{i}.log").read_text()) for i in range(2)]
    assert {0, 1, 2} <= reached[0] & reached[1], reached


def test_a_killed_relay_is_replaced_and_its_rollout_pulls_from_the_replacement(tmp_path,
                                                                                cache_dir):
    run_dir = tmp_path / "run"
    steps = 8
    # relay1, rollout 1's home, is SIGKILLed in step 2; the supervisor starts another on
    # its node (this host), which joins the chain and serves once it has caught up.
    assert main(["--steps", str(steps), "--eval-every", "100", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, "--rollout.num-servers", "2",
                 "--relay.num-relays", "2", "--faults.inject", "relay1:at=2", *SMALL]) == 0
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    faults = read_jsonl(run_dir / "faults.jsonl")
    (repair,) = [f for f in faults if f["event"] == "chain_repaired"]
    assert (repair["role"], repair["cause"]) == ("relay1", "exited")
    (recovered,) = [f for f in faults if f["event"] == "recovered"]
    assert recovered["role"] == "relay1" and recovered["t"] >= repair["t"]
    roles = json.loads((run_dir / "roles.json").read_text())
    replacement = roles["relay1"]["address"]
    assert recovered["address"] == replacement
    logs = run_dir / "logs"
    loads = loaded_versions((logs / "rollout1.log").read_text())
    # Before the kill rollout 1 pulled from the first relay1, meanwhile from relay0, and
    # after the join from the replacement (a new address: every such pull came after it),
    # never a version older than the one the replacement held when it began to serve.
    assert loads[0][1] not in (replacement, roles["relay0"]["address"])
    after = [v for v, a in loads if a == replacement]
    assert after, f"rollout1 never pulled from the replacement: {loads}"
    assert min(after) >= recovered["version"]
    # The replacement got versions by the chain only (the trainer publishes to relay0).
    assert set(after) <= visible_versions((logs / "relay1.log").read_text())
