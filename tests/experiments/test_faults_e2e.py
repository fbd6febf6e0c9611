"""Kill roles mid-run (real SIGKILLs of real processes) and lose nothing. (A killed
controller's resume: tests/backends/test_cluster_lifetime.py, with its clean-up.)

Each run must complete, keep the staleness bound on every consumed batch, and account
for every trajectory by id: consumed exactly once, or in a group dropped on purpose, or
still in the partial response pool at the end; none lost, none duplicated.
"""

import json
import re

import numpy as np
import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.backends.roles import read_roles
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.experiments.math_grpo import main
from fnrl.control.journal import records as journal_records

from tests.experiments.e2e_args import SMALL
from tests.experiments.test_presets_e2e import pool_records

pytestmark = pytest.mark.slow

GROUP_SIZE = 8   # AlgoConfig's default


def _events(run_dir):
    return read_jsonl(run_dir / "faults.jsonl")


def _run_two_rollouts(run_dir, cache_dir, steps: int, *flags: str) -> int:
    """The main job, in this process, with two rollouts, the small model and `flags`."""
    return main(["--steps", str(steps), "--eval.every", "100", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, "--rollout.num-servers", "2", *flags,
                 *SMALL])


def assert_nothing_lost(run_dir, *, steps: int, eta: int):
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train and max(r["step"] for r in train) == steps
    for r in train:
        if not r.get("recovered_from_journal"):   # trained while no controller watched
            assert r["staleness_checked_tokens"] > 0 and r["staleness_checked_max"] <= eta
    journal = journal_records(run_dir / "journal.jsonl")
    filled = {j["problem"]["uid"]: j["uids"] for j in journal if j["ev"] == "fill"}
    dropped = {g for j in journal if j["ev"] == "drop" for g in j["groups"]}
    consumed = [json.loads(l) for l in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    groups = [g["group"] for g in consumed]
    assert len(groups) == len(set(groups)), "a group was consumed twice"
    uids = [t["uid"] for g in consumed for t in g["trajectories"]]
    assert len(uids) == len(set(uids)), "a trajectory was consumed twice"
    assert len(groups) == 4 * steps   # every step trained a full batch (groups-per-step 4)
    for g in consumed:
        assert sorted(t["uid"] for t in g["trajectories"]) == sorted(filled[g["group"]])
        for t in g["trajectories"]:
            assert min(v for v, _ in t["segments"]) + eta >= g["consumed_version"]
    # The versions each rollout loaded never go back, across its restarts and the
    # trainer's (a restarted trainer resumes from a checkpoint no older than what it
    # published; a restarted server loads the newest before it serves).
    for log in (run_dir / "logs").glob("rollout*.log"):
        loaded = [int(v) for v in re.findall(r"fnrl_pull: version (\d+)", log.read_text())]
        assert loaded == sorted(loaded), (log.name, loaded)
    # Pool-log accounting: a trajectory that streamed a token is consumed, in a group
    # dropped on purpose, discarded by recovery as too stale (journaled), or still in
    # the pool at the end with its tokens; nothing else.
    log = pool_records(run_dir / "partial_responses.log")
    streamed = {r["uid"] for r in log if r["op"] == "tokens"}
    discarded = {u for j in journal if j["ev"] == "discard" for u in j["uids"]}
    in_dropped = {u for name in dropped for u in filled.get(name, ())}
    pool = PartialResponsePool(run_dir / "partial_responses.log")
    try:
        live = set(pool.live())
    finally:
        pool.close()
    assert not live & set(uids), "a consumed trajectory is still in the pool"
    lost = streamed - set(uids) - in_dropped - discarded - live
    assert not lost, f"streamed tokens lost: {sorted(lost)[:5]}"


def test_role_kills_trainer_rollout_and_relays_are_survived(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    steps = 8
    assert _run_two_rollouts(run_dir, cache_dir, steps,
        "--relay.num-relays", "3",
        # trainer mid-step at 3 and 6; rollout 1 mid-generation at 4; the middle relay
        # at 3 and again at 6 (its replacement); the master relay at 7 (a new master is
        # elected, the trainer follows it).
        "--faults.inject.kills", "trainer:every=3", "rollout1:at=4", "relay1:every=3",
        "relay0:at=7") == 0
    events = _events(run_dir)
    recovered = {e["role"] for e in events if e["event"] == "recovered"}
    # The killed relays were replaced on this host (and joined the chain again).
    assert recovered == {"trainer", "rollout1", "relay0", "relay1"}
    assert sum(e["event"] == "recovered" and e["role"] == "trainer" for e in events) == 2
    kills = [e["role"] for e in events if e["event"] == "inject"]
    assert sorted(kills) == ["relay0", "relay1", "relay1", "rollout1", "trainer", "trainer"]
    assert not [e for e in events if e["event"] == "restart_failed"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Every kill is a failure, relays' included; each relay is down until its
    # replacement serves, and ETTR counts it (not only the chain's splice).
    assert summary["version"] == steps and summary["failures"] == len(kills)
    relay_down = [e["down_s"] for e in events if e["event"] == "recovered"
                  and e["role"].startswith("relay")]
    repairs = [e["repair_s"] for e in events if e["event"] == "chain_repaired"]
    assert len(relay_down) == 3 and sum(relay_down) > sum(repairs)
    assert summary["role_down_s_all"] >= sum(relay_down)
    assert summary["relay_recovery_s_mean"] == pytest.approx(np.mean(relay_down), rel=1e-6)
    # roles.json follows the replacements: it names the last relay1 that was started.
    last = [e for e in events if e["event"] == "recovered" and e["role"] == "relay1"][-1]
    assert read_roles(run_dir / "roles.json")["relay1"]["pid"] == last["pid"]
    # Rollouts reached the last version through the repaired chain (relay2 survives,
    # the replacements joined behind it).
    assert summary["last_eval"]["version"] == steps
    assert_nothing_lost(run_dir, steps=steps, eta=2)


def test_hung_roles_are_found_by_their_detection_windows(tmp_path, cache_dir):
    # SIGSTOP: the processes live on, silent. A rollout is failed only after zero
    # throughput for rollout_stall_s AND a heartbeat missing for heartbeat_timeout_s; the
    # trainer after trainer_hang_s without progress inside a training step.
    run_dir = tmp_path / "run"
    steps = 6
    assert _run_two_rollouts(run_dir, cache_dir, steps,
        "--faults.inject.kills", "rollout1:at=2:signal=stop", "trainer:at=4:signal=stop",
        "--faults.rollout-stall-s", "3", "--faults.heartbeat-timeout-s", "2",
        # The hang window must exceed a real step, the first (compiling) one included.
        "--faults.trainer-hang-s", "30") == 0
    events = _events(run_dir)
    reasons = {e["role"]: e["reason"] for e in events if e["event"] == "failure"}
    assert reasons.keys() == {"rollout1", "trainer"}
    assert reasons["rollout1"].startswith("zero throughput for") and "no heartbeat" in reasons["rollout1"]
    assert reasons["trainer"].startswith("no progress for")
    # (The hung rollout's replacement server may still be starting when the run ends:
    # rollout 0 carries the work meanwhile; the kill test above sees a restart through.)
    assert "trainer" in {e["role"] for e in events if e["event"] == "recovered"}
    assert_nothing_lost(run_dir, steps=steps, eta=2)
