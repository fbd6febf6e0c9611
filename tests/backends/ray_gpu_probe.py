"""Run by test_ray_gpus.py as its own process (it enters a loopback-only network
namespace, which needs a process without threads): a Ray test cluster whose nodes declare
GPUs (a 2, b 4), the Ray launcher placing a trainer of 2 GPUs and two tensor-parallel-2
rollouts on it, and what each role's process sees as CUDA_VISIBLE_DEVICES.

    python tests/backends/ray_gpu_probe.py OUT_DIR    # writes OUT_DIR/probe.json
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fnrl.shell.netns import enter_loopback_namespace


def main(out: Path) -> None:
    enter_loopback_namespace()
    from fnrl.config import ClusterConfig
    from fnrl.backends.ray_cluster import RayLauncher
    from fnrl.experiments.ray_local import NODE_LABEL, start_cluster
    temp_dir = tempfile.mkdtemp(prefix="fnrl-ray-")
    cluster = launcher = None
    try:
        cluster, _ = start_cluster(["a", "b"], temp_dir, gpus={"a": 2, "b": 4})
        launcher = RayLauncher(
            ClusterConfig(backend="ray", ray_address=cluster.address, node_label=NODE_LABEL,
                          trainer_node="a"),
            2, with_eval=False, gpus_per_process=2, trainer_processes=1,
            tensor_parallel_size=2)
        seen = {}
        for role in ("trainer", "rollout0", "rollout1", "relay1"):
            path = out / f"{role}.txt"
            proc = launcher.spawn(role, ["sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {path}'],
                                  out / f"{role}.log")
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            seen[role] = path.read_text().strip()
        (out / "probe.json").write_text(json.dumps({
            "rollouts": list(launcher.placement.rollouts), "granted": launcher.gpu_ids,
            "seen": seen}))
    finally:
        if launcher is not None:
            launcher.close()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
