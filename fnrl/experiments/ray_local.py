"""The main job on a Ray cluster of several logical nodes on this machine, confined to
loopback: how the Ray backend is tried on a laptop and tested in CI.

    python -m fnrl.experiments.ray_local --nodes a,b,c -- --steps 5 --rollout.num-servers 2

Each node is a raylet of Ray's own test cluster (`ray.cluster_utils.Cluster`), labelled
`fnrl-node=<name>`; the job runs with `--cluster.backend ray` against it, so the trainer,
the rollouts and one relay per node are placed and started by Ray exactly as on a real
cluster (fnrl.backends.ray_cluster). The whole thing runs in a network namespace of its
own with only loopback up (fnrl.shell.netns): Ray listens on every interface and probes
an outside address for the host's, and here neither reaches past 127.0.0.1. At the end
the cluster's processes are stopped by their handles and its temporary directory is
removed; Ctrl-C and SIGTERM do the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from fnrl.shell.netns import enter_loopback_namespace

NODE_LABEL = "fnrl-node"
OBJECT_STORE_BYTES = 80 << 20   # the job moves no data through Ray: its minimum


def start_cluster(nodes: list[str], temp_dir: str, gpus: dict[str, int] | None = None):
    """A Ray test cluster with one raylet per name, all on 127.0.0.1 (head: the first),
    and the workers' node handles by name. `gpus` declares GPU counts per node (Ray's
    `GPU` resource: what the placement reads and reserves, not devices)."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    # The test cluster records its address in Ray's default directory (/tmp/ray), which
    # only a default-started Ray creates: without it the head fails to start.
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    common = dict(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES,
                  node_ip_address="127.0.0.1")
    gpus = gpus or {}
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        common, labels={NODE_LABEL: nodes[0]}, include_dashboard=False, temp_dir=temp_dir,
        num_gpus=gpus.get(nodes[0], 0)))
    try:
        workers = {name: cluster.add_node(**common, labels={NODE_LABEL: name},
                                          num_gpus=gpus.get(name, 0))
                   for name in nodes[1:]}
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, workers


def trained_steps(run_dir: Path) -> int:
    """The newest train step in the run's metrics (0 before the first)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue   # the line being written
        if record.get("kind") == "train":
            steps.append(int(record["step"]))
    return max(steps)


def lose_node_after(cluster, node, run_dir: Path, step: int, done: threading.Event) -> None:
    """Removes `node`'s raylet (its workers, its node host and every role that host
    started die with it) once the run has trained `step` steps: a lost machine."""
    if _after_step(run_dir, step, done):
        print(f"ray_local: losing a node after step {step}", flush=True)
        cluster.remove_node(node, allow_graceful=False)


def _after_step(run_dir: Path, step: int, done: threading.Event) -> bool:
    """Waits until the run has trained `step` steps (True), or the job ended (False)."""
    while not done.wait(0.5):
        if trained_steps(run_dir) >= step:
            return True
    return False


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def hang_node_after(node: str, run_dir: Path, step: int, seconds: float,
                    done: threading.Event) -> None:
    """SIGSTOPs `node`'s host actor and every role it started (its raylet runs on) once
    the run has trained `step` steps, and SIGCONTs what is left of them `seconds` later:
    a node that stops answering (a frozen machine, a host stuck in the kernel)."""
    if not _after_step(run_dir, step, done):
        return
    roles = json.loads((run_dir / "roles.json").read_text())
    mine = {name: info["pid"] for name, info in roles.items() if info["node"] == node}
    hosts = {_parent(pid) for pid in mine.values()}
    groups = {os.getpgid(pid) for pid in mine.values()}
    for pid in hosts:
        os.kill(pid, signal.SIGSTOP)
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    print(f"ray_local: node {node} hung ({sorted(mine)}, groups {sorted(groups)}, and their "
          f"host, pid {sorted(hosts)}) at epoch {time.time():.3f}", flush=True)
    done.wait(seconds)
    for pid in hosts:
        _signal(lambda: os.kill(pid, signal.SIGCONT))
    for group in groups:
        _signal(lambda: os.killpg(group, signal.SIGCONT))
    print(f"ray_local: node {node} resumed at epoch {time.time():.3f}", flush=True)


def _signal(send) -> None:
    try:
        send()
    except ProcessLookupError:   # killed meanwhile (a lost node's host is killed via Ray)
        pass


def kill_head_after(cluster, run_dir: Path, step: int, done: threading.Event) -> None:
    """SIGKILLs the head's GCS server once the run has trained `step` steps: the cluster's
    control store is gone (the raylets and the job's processes run on)."""
    if _after_step(run_dir, step, done):
        cluster.head_node.kill_gcs_server()
        print(f"ray_local: the head's GCS killed after step {step} at epoch "
              f"{time.time():.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="a,b,c", help="node names, the trainer's first")
    parser.add_argument("--trainer-node", default="", metavar="NAME",
                        help="the trainer's node (default: the first)")
    parser.add_argument("--lose-node", default="", metavar="NAME",
                        help="a fault: remove this node (not the head) mid-run")
    parser.add_argument("--lose-after-step", type=int, default=2, metavar="K",
                        help="remove --lose-node once K steps are trained")
    parser.add_argument("--hang-node", default="", metavar="NAME",
                        help="a fault: SIGSTOP this node's host and roles mid-run")
    parser.add_argument("--hang-after-step", type=int, default=2, metavar="K")
    parser.add_argument("--hang-s", type=float, default=60.0, metavar="S",
                        help="SIGCONT what is left of the hung node after S seconds")
    parser.add_argument("--kill-head-after-step", type=int, default=0, metavar="K",
                        help="a fault: SIGKILL the head's GCS once K steps are trained")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    nodes = [n for n in args.nodes.split(",") if n]
    if len(set(nodes)) != len(nodes) or not nodes:
        parser.error(f"--nodes {args.nodes!r}: distinct names, at least one")
    if args.lose_node and args.lose_node not in nodes[1:]:
        parser.error(f"--lose-node {args.lose_node!r}: must be one of {nodes[1:]} (not the "
                     f"head, {nodes[0]!r}, which holds the cluster's control store)")
    if args.trainer_node and args.trainer_node not in nodes:
        parser.error(f"--trainer-node {args.trainer_node!r}: not one of {nodes}")
    if args.hang_node and args.hang_node not in nodes[1:]:
        parser.error(f"--hang-node {args.hang_node!r}: must be one of {nodes[1:]}")
    faults = args.lose_node or args.hang_node or args.kill_head_after_step
    if faults and "--run-dir" not in job_args:
        parser.error("a fault (--lose-node, --hang-node, --kill-head-after-step) needs the "
                     "job's --run-dir (to see its steps)")
    enter_loopback_namespace()   # first: no thread may run yet
    # SIGTERM and SIGHUP unwind like Ctrl-C, through the finally below.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    temp_dir = tempfile.mkdtemp(prefix="fnrl-ray-")   # short: Ray's socket paths live here
    print(f"ray_local: nodes {nodes} on 127.0.0.1, Ray's files in {temp_dir}", flush=True)
    cluster, done = None, threading.Event()
    try:
        cluster, workers = start_cluster(nodes, temp_dir)
        print(f"ray_local: cluster up at epoch {time.time():.3f}", flush=True)
        run_dir = Path(job_args[job_args.index("--run-dir") + 1]) if faults else None
        for target, fault_args in (
                (lose_node_after, args.lose_node and (
                    cluster, workers.get(args.lose_node), run_dir, args.lose_after_step, done)),
                (hang_node_after, args.hang_node and (
                    args.hang_node, run_dir, args.hang_after_step, args.hang_s, done)),
                (kill_head_after, args.kill_head_after_step and (
                    cluster, run_dir, args.kill_head_after_step, done))):
            if fault_args:
                threading.Thread(target=target, args=fault_args, daemon=True).start()
        from fnrl.experiments.math_grpo import main as job_main
        return job_main([*job_args, "--cluster.backend", "ray", "--cluster.ray-address",
                         cluster.address, "--cluster.node-label", NODE_LABEL,
                         "--cluster.trainer-node", args.trainer_node or nodes[0]])
    finally:
        done.set()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
