"""The Ray launcher's GPU bookkeeping, without a Ray cluster: nodes and their GPU counts
read from `ray.nodes()`, and each role's CUDA_VISIBLE_DEVICES from its planned indices
into the GPUs Ray granted its node's host (fnrl.backends.ray_cluster)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from fnrl.backends.ray_cluster import name_nodes, visible_devices  # noqa: E402
from fnrl.policy.placement import place_roles  # noqa: E402


def test_nodes_are_named_by_label_with_their_gpu_counts():
    listed = [
        {"NodeID": "ffff0000c", "Alive": True, "Labels": {"fnrl-node": "c"},
         "Resources": {"CPU": 8.0, "GPU": 2.0}},
        {"NodeID": "ffff0000a", "Alive": True, "Labels": {"fnrl-node": "a"},
         "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"NodeID": "ffff0000x", "Alive": False, "Labels": {"fnrl-node": "x"},
         "Resources": {"GPU": 8.0}},
        {"NodeID": "12345678ab", "Alive": True, "Labels": {}, "Resources": {"CPU": 2.0}},
    ]
    assert name_nodes(listed, "fnrl-node") == {
        "12345678": ("12345678ab", 0), "a": ("ffff0000a", 4), "c": ("ffff0000c", 2)}


def test_roles_on_a_node_see_disjoint_gpus_of_those_ray_granted():
    plan = place_roles(("a", "b"), 2, node_gpus={"a": 2, "b": 8}, trainer_gpus=2,
                       server_gpus=4, with_eval=False)
    # Ray granted b's host (num_gpus=8) these ids; the roles split them, in plan order.
    granted = {"a": ["0", "1"], "b": ["1", "2", "3", "5", "6", "7", "8", "9"]}
    seen = {role: visible_devices(granted[plan.node_of(role)], ids)
            for role, ids in plan.gpus.items()}
    assert seen == {"trainer": "0,1", "rollout0": "1,2,3,5", "rollout1": "6,7,8,9"}
    assert plan.gpus_on("b") == 8
    # A relay (no GPUs planned) gets no variable; a plan beyond the grant is an error.
    assert visible_devices(granted["b"], ()) == ""
    with pytest.raises(RuntimeError, match="host was granted 2"):
        visible_devices(["0", "1"], (1, 2))


@pytest.mark.slow   # starts a two-node Ray cluster: the whole suite's, not the inner loop's
def test_on_a_ray_cluster_each_role_sees_the_gpus_its_node_host_reserved(tmp_path):
    """A real Ray test cluster whose nodes declare GPUs (a 2, b 4: Ray's `GPU` resource,
    no devices): Ray grants each host its roles' GPUs, and each role's process sees its
    own slice (tests/backends/ray_gpu_probe.py)."""
    probe = Path(__file__).with_name("ray_gpu_probe.py")
    done = subprocess.run([sys.executable, str(probe), str(tmp_path)], timeout=240,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "probe.json").read_text())
    assert result["rollouts"] == ["b", "b"]
    assert result["granted"] == {"a": ["0", "1"], "b": ["0", "1", "2", "3"]}
    # The relay reserves none and sees its host's (documented in docs/multinode.md).
    assert result["seen"] == {"trainer": "0,1", "rollout0": "0,1", "rollout1": "2,3",
                              "relay1": "0,1,2,3"}
