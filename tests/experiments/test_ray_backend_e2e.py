"""The main job on the Ray backend: a three-node Ray cluster on this machine, confined to
loopback (fnrl.experiments.ray_local), with the trainer on node a (as two JAX processes
in the first test), rollouts on b and c and a relay on each node. Partial failures real
clusters have: in the first run node c hangs (its host actor and roles SIGSTOPped, its
raylet running) past the fault window; in the second the trainer's node is lost, then
the cluster's head (its GCS) is killed, and a re-run on a new cluster resumes."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _group_alive(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def test_roles_run_where_placed_and_a_hung_node_moves_its_rollout_losing_nothing(tmp_path,
                                                                                 cache_dir):
    """Three nodes: the trainer as two JAX processes on a (node a's host starts the
    group's leader, fnrl.trainer.group, which starts both beside it with the coordinator
    at node a's address; only process 0 answers the controller and publishes), a relay
    per node, rollouts on b and c, each pulling from its own node's relay. After step 2
    node c hangs: its host actor and the rollout and relay it started are SIGSTOPped
    (its raylet runs on). The controller never waits on it: rollout0 keeps generating,
    and once c has not answered for the fault window (`faults.node_timeout_s`) it is
    lost: its host is killed through Ray (its roles with it), the relay is spliced out
    of the chain, the rollout is restarted on a surviving node, and the run finishes
    with every group consumed once."""
    run_dir = tmp_path / "run"
    window = 15   # a healthy host answers within 0.5 s; margin for a busy machine
    proc = subprocess.run(
        [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b,c",
         "--hang-node", "c", "--hang-after-step", "2", "--hang-s", "600", "--",
         "--steps", "6", "--rollout.num-servers", "2", "--faults.node-timeout-s", str(window),
         "--trainer.distributed.num-processes", "2", "--trainer.distributed.local-devices", "1",
         "--run-dir", str(run_dir), "--warm-start.cache-dir", cache_dir, *SMALL,
         "--eval.server", "off"],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hung = re.search(r"node c hung \(.*, groups \[(.*)\], and their host, pid \[(\d+)\]\) "
                     r"at epoch (\S+)", proc.stdout)
    hung_at = float(hung.group(3))
    # The hung host was killed through Ray, and every process of its roles with it.
    groups = [int(g) for g in hung.group(1).split(", ")]
    assert not _alive(int(hung.group(2))) and not any(_group_alive(g) for g in groups)
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

    # The hung node's relay was spliced out as stopped by the tier's monitor, and not
    # replaced (it held its place until its node was lost); its rollout failed with the
    # node named and was restarted.
    events = read_jsonl(run_dir / "faults.jsonl")
    assert any(e["event"] == "chain_repaired" and e["role"] == "relay2" and
               e["cause"] == "stopped" for e in events)
    assert not any(e["event"] == "recovered" and e["role"] == "relay2" for e in events)
    failure = [e for e in events if e["event"] == "failure" and e["role"] == "rollout1"]
    assert failure and failure[0]["reason"] == (
        f"process was lost with its node (its Ray host did not answer for {window} s: "
        "hung) on node c")
    assert any(e["event"] == "recovered" and e["role"] == "rollout1" for e in events)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_nodes"] == {"c": f"its Ray host did not answer for {window} s: hung"}
    # While c hung, before it was found lost, the controller went on: its loop observed
    # the cluster every quarter second or so (the timeline's samples), and the healthy
    # rollout's tokens were read as they came (a controller waiting on c reads none).
    (start,) = [r["epoch"] for r in read_jsonl(run_dir / "attempts.jsonl")
                if r["event"] == "start"]
    timeline = [r for r in json.loads((run_dir / "timeline.json").read_text())
                if "tokens" in r and hung_at - start < r["t"] <= hung_at - start + window]
    times = [r["t"] for r in timeline]
    # (A frozen loop samples nothing until the node is lost: one gap of the window.)
    assert len(times) >= 5 and max(np.diff(times)) < window / 2, times
    rate = (timeline[-1]["tokens"][0] - timeline[0]["tokens"][0]) / (times[-1] - times[0])
    assert rate > 0, timeline

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


def test_losing_the_trainers_node_then_the_head_stops_cleanly_and_a_rerun_resumes(tmp_path,
                                                                                   cache_dir):
    """The trainer and the chain's master relay run on node b, which is lost after step 2:
    the master is re-elected among the survivors, the trainer restarts on another node
    from the step's checkpoint and batch log. After step 4 the head's GCS is killed: the
    job names the fault, writes its summary and an end record, stops every role and
    exits with its own code well before Ray's own 60 s exit, and ray_local removes its
    cluster. A re-run with the same run dir on a new cluster finishes the run with
    nothing lost or trained twice."""
    run_dir = tmp_path / "run"
    # Steps enough to outlast the head's 10 s detection window (a step takes 1-3 s).
    job = ["--steps", "16", "--rollout.num-servers", "2", "--run-dir", str(run_dir),
           "--warm-start.cache-dir", cache_dir, *SMALL, "--eval.server", "off"]
    proc = subprocess.run(
        [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b,c",
         "--trainer-node", "b", "--lose-node", "b", "--lose-after-step", "2",
         "--kill-head-after-step", "4", "--", *job],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 6, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GCS killed after step 4" in proc.stdout
    roles = json.loads((run_dir / "roles.json").read_text())
    assert roles["relay0"]["node"] == "b" and roles["trainer"]["node"] in ("a", "c")
    events = read_jsonl(run_dir / "faults.jsonl")
    failure = [e for e in events if e["event"] == "failure" and e["role"] == "trainer"]
    assert failure and "lost with its node (its Ray host actor died) on node b" in (
        failure[0]["reason"])
    assert any(e["event"] == "chain_repaired" and e["role"] == "relay0" and e["was_master"]
               for e in events)
    assert any(e["event"] == "recovered" and e["role"] == "trainer" for e in events)
    # The head's loss: named in the faults, the attempt's end and the summary.
    (lost,) = [e for e in events if e["event"] == "cluster_lost"]
    assert "the Ray cluster's head (its GCS at 127.0.0.1:" in lost["reason"]
    end = read_jsonl(run_dir / "attempts.jsonl")[-1]
    assert end["event"] == "end" and end["cluster_lost"] == lost["reason"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cluster_lost"] == lost["reason"]
    assert "fnrl: stopped: the Ray cluster's head" in proc.stderr
    # Stopped by fnrl, before Ray's own exit 60 s after the loss ("Failed to connect to
    # GCS within 60 seconds... The program will terminate"), which would end it with 1.
    assert "Failed to connect to GCS" not in proc.stderr
    temp_dir = re.search(r"Ray's files in (\S+)", proc.stdout).group(1)
    assert not _ours_left(temp_dir) and not Path(temp_dir).exists()

    rerun = subprocess.run(
        [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b,c",
         "--trainer-node", "b", "--", *job], capture_output=True, text=True, timeout=1200)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert sorted({r["step"] for r in train}) == list(range(1, 17))
    assert_nothing_lost(run_dir, steps=16, eta=2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_removes_ray_locals_cluster(tmp_path, cache_dir, sig):
    """ray_local's cluster goes on every way out: here a stop signal as soon as the
    cluster is up (the job is then starting its roles on it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b", "--",
         "--steps", "1", "--run-dir", str(tmp_path / "run"), "--warm-start.cache-dir",
         cache_dir, *SMALL, "--eval.server", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        temp_dir = None
        for line in proc.stdout:
            temp_dir = temp_dir or re.search(r"Ray's files in (\S+)", line)
            if "cluster up" in line:
                break
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert temp_dir and not _ours_left(temp_dir.group(1))
    assert not Path(temp_dir.group(1)).exists()
