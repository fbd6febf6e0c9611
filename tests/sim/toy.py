"""The toy cluster the hand-worked schedules use (tests/sim/test_sim.py, test_real_loop.py)."""

from __future__ import annotations

from fnrl.sim.config import ClusterSpec, SimConfig
from fnrl.sim.workload import WorkloadSpec

# A toy cluster: every decode step 1 s, prefill 0.1 s a token (2e9 FLOPs / (1e12 · 0.02)),
# a train step 6·1e9·tokens / (1e12 · 0.6) = 0.01 s a token, a 1 s publish stall
# (2e9 bytes / 2e9 B/s), a 0.5 s pull (2e9 bytes / 4e9 B/s).
TOY = {
    "gpu": {"toy": {"peak_flops": 1e12, "hbm_bytes": 1e12, "hbm_bw": 1e12, "pcie_bw": 4e9,
                    "nic_bw": 1e9}},
    "model": {"toy": {"params": 1e9, "active_params": 1e9, "layers": 0, "attn_dim": 0,
                      "kv_bytes_per_token": 1}},
    "decode": {"toy": {"k1": 0.0, "k2": 0.0, "k3": 0.0, "k4": 1.0, "k5": 1.0}},
    "roofline": {"prefill_mfu": 0.02},
    "sync": {"push_bw": 2e9, "reload_s": 0.0},
    "train": {"logprob_forward": False},
}


def toy_cfg(preset="sync", **kw) -> SimConfig:
    cluster = ClusterSpec(gpu="toy", model="toy", decode="toy", train_gpus=1, rollout_tp=1,
                          kv_capacity_tokens=100, train_mfu=0.6)
    workload = WorkloadSpec(groups_per_step=2, group_size=2, prompt_len=2, response="fixed",
                            len_median=3, len_max=3)
    return SimConfig(preset=preset, gpus=2, steps=2, cycle_s=0.0, cluster=cluster,
                     workload=workload, plots=False, **kw)
