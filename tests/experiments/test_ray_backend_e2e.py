"""The main job on the Ray backend: a three-node Ray cluster on this machine, confined to
loopback (fnrl.experiments.ray_local), with the trainer on node a (as two JAX processes
in the first test), rollouts on b and c and a relay on each node; a node is lost in
each run (a rollout's in the first, the trainer's in the second)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fnrl.control.metrics import read_jsonl

from tests.experiments.e2e_args import SMALL
from tests.experiments.test_faults_e2e import assert_nothing_lost

pytestmark = pytest.mark.slow


def _ours_left(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (Ray's temp dir)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd:
                out.append(cmd)
    return out


def test_roles_run_where_placed_and_a_lost_node_moves_its_rollout_losing_nothing(tmp_path,
                                                                                 cache_dir):
    """Three nodes: the trainer as two JAX processes on a (node a's host starts the
    group's leader, fnrl.trainer.group, which starts both beside it with the coordinator
    at node a's address; only process 0 answers the controller and publishes), a relay
    per node, rollouts on b and c, each pulling from its own node's relay. Node c's
    raylet is removed after step 2: its host actor dies and the rollout and relay it
    started die with it. The relay is spliced out of the chain, the rollout is restarted
    on a surviving node, and the run finishes with every group consumed once."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b,c",
         "--lose-node", "c", "--lose-after-step", "2", "--",
         "--steps", "6", "--rollout.num-servers", "2",
         "--trainer.distributed.num-processes", "2", "--trainer.distributed.local-devices", "1",
         "--run-dir", str(run_dir), "--warm-start.cache-dir", cache_dir, *SMALL,
         "--eval.server", "off"],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "losing a node after step 2" in proc.stdout
    temp_dir = re.search(r"Ray's files in (\S+)", proc.stdout).group(1)

    # Where each role ran last: rollout1 moved from the lost c to b (the generation
    # node left); c's relay was not started again.
    roles = json.loads((run_dir / "roles.json").read_text())
    where = {name: info["node"] for name, info in roles.items()}
    assert where == {"trainer": "a", "relay0": "a", "rollout0": "b", "relay1": "b",
                     "rollout1": "b", "relay2": "c"}
    # The node ids the hosts reported: one per node, three nodes.
    ids = {info["node"]: info["node_id"] for info in roles.values()}
    assert len(set(ids.values())) == 3
    assert all(roles[n]["node_id"] == ids[roles[n]["node"]] for n in roles)
    # The trainer's two processes: children of the leader node a's host started, joined
    # at node a's address (the trainer's own).
    group = json.loads((run_dir / "logs" / "trainer.group.json").read_text())
    assert group["leader"] == roles["trainer"]["pid"] and len(group["pids"]) == 2
    node_a_host = roles["trainer"]["address"].removeprefix("tcp://").rsplit(":", 1)[0]
    assert group["coordinator"].rsplit(":", 1)[0] == node_a_host
    for rank, log in enumerate(["trainer.log", "trainer.rank1.log"]):
        text = (run_dir / "logs" / log).read_text()
        assert (f"trainer process {rank} of 2 joined (coordinator {group['coordinator']}, "
                f"2 devices, pid {group['pids'][rank]})") in text, text[-2000:]
    # Each rollout pulled from the relay on its own node: rollout0 from b's throughout,
    # rollout1 from c's until c was lost, then from b's.
    def pulls(rid: int) -> list[str]:
        return re.findall(r"fnrl_pull: version \d+ from relay (\S+)",
                          (run_dir / "logs" / f"rollout{rid}.log").read_text())
    assert set(pulls(0)) == {roles["relay1"]["address"]}
    assert pulls(1)[0] == roles["relay2"]["address"]
    assert pulls(1)[-1] == roles["relay1"]["address"]

    # The lost node's relay was spliced out and not replaced (a relay is started again
    # only on its own node); its rollout failed with the node named and was restarted.
    events = read_jsonl(run_dir / "faults.jsonl")
    assert any(e["event"] == "chain_repaired" and e["role"] == "relay2" for e in events)
    (not_replaced,) = [e for e in events if e["event"] == "restart_failed"
                       and e["role"] == "relay2"]
    assert "is lost; no replacement" in not_replaced["error"]
    assert not any(e["event"] == "recovered" and e["role"] == "relay2" for e in events)
    failure = [e for e in events if e["event"] == "failure" and e["role"] == "rollout1"]
    assert failure and "lost with its node" in failure[0]["reason"]
    assert any(e["event"] == "recovered" and e["role"] == "rollout1" for e in events)

    # What the single-host run shows holds here too.
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert max(max(r["rollout_versions"]) for r in train) >= 1
    for r in train:
        assert sum(r["staleness_hist"]) == r["tokens"] > 0
        assert r["staleness_max"] <= 4
    fresh = [r for r in train if r["staleness_max"] == 0]
    assert fresh and all(r["logp_abs_diff"] < 1e-2 for r in fresh)
    # Every trajectory consumed once, dropped on purpose, or still pooled; the staleness
    # bound (the default preset's η = 2) held on every batch.
    assert_nothing_lost(run_dir, steps=6, eta=2)
    # Nothing of the cluster outlives the job: no Ray process, no temporary directory.
    assert not _ours_left(temp_dir) and not Path(temp_dir).exists()


def test_losing_the_trainers_node_restarts_the_trainer_elsewhere(tmp_path, cache_dir):
    """The trainer and the chain's master relay run on node b, which is lost after step 2:
    the master is re-elected among the survivors, the trainer restarts on another node
    from the step's checkpoint and batch log, and the run finishes with nothing lost."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b,c",
         "--trainer-node", "b", "--lose-node", "b", "--lose-after-step", "2", "--",
         "--steps", "6", "--rollout.num-servers", "2",
         "--run-dir", str(run_dir), "--warm-start.cache-dir", cache_dir, *SMALL,
         "--eval.server", "off"],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    roles = json.loads((run_dir / "roles.json").read_text())
    assert roles["relay0"]["node"] == "b" and roles["trainer"]["node"] in ("a", "c")
    events = read_jsonl(run_dir / "faults.jsonl")
    failure = [e for e in events if e["event"] == "failure" and e["role"] == "trainer"]
    assert failure and "lost with its node" in failure[0]["reason"]
    assert any(e["event"] == "chain_repaired" and e["role"] == "relay0" and e["was_master"]
               for e in events)
    assert any(e["event"] == "recovered" and e["role"] == "trainer" for e in events)
    assert_nothing_lost(run_dir, steps=6, eta=2)
