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
