"""The simulator's cost models against hand-computed values."""

from __future__ import annotations

import json

import pytest

from fnrl.config import CostModel
from fnrl.sim import costs

TABLE4 = CostModel(k1=7.28e-8, k2=1.72e-3, k3=1.25e-4, k4=1.07e-2, k5=1.0)


def test_step_time_is_staleflow_eq_11():
    # 7.28e-8·10000 + max(1.72e-3, 1.25e-4·8 = 1e-3) + 1.07e-2
    assert costs.step_s(TABLE4, 10_000, 8) == pytest.approx(7.28e-4 + 1.72e-3 + 1.07e-2)
    # Past the roofline (n = 32 > k2/k3 = 13.8) the per-sequence term wins: 4e-3.
    assert costs.step_s(TABLE4, 0, 32) == pytest.approx(4e-3 + 1.07e-2)
    assert costs.named_decode("staleflow-qwen3-30b-a3b-h20") == TABLE4


def test_closed_form_steps_match_walking_them():
    kv0, n = 5000.0, 20
    walked = sum(costs.step_s(TABLE4, kv0 + n * j, n) for j in range(300))
    assert costs.decode_steps_s(TABLE4, kv0, n, 300) == pytest.approx(walked, rel=1e-12)
    t = costs.decode_steps_s(TABLE4, kv0, n, 300)
    assert costs.steps_within(TABLE4, kv0, n, t) == 300
    assert costs.steps_within(TABLE4, kv0, n, t - 1e-9) == 299
    assert costs.steps_within(TABLE4, kv0, n, 0.0) == 0
    flat = CostModel(k1=0.0, k2=0.0, k3=0.0, k4=0.5)
    assert costs.steps_within(flat, 0, 3, 1.49) == 2


def test_roofline_decode_and_kv_capacity():
    gpu = costs.GpuSpec(peak_flops=1e15, hbm_bytes=80e9, hbm_bw=2e12, pcie_bw=50e9, nic_bw=50e9)
    model = costs.ModelSpec(params=10e9, active_params=5e9, layers=10, attn_dim=1000,
                            kv_bytes_per_token=1e5)
    roof = costs.RooflineParams(hbm_efficiency=0.5, decode_mfu=0.5, step_overhead_s=1e-3,
                                prefill_mfu=0.4, kv_memory_fraction=0.9)
    d = costs.roofline_decode(model, gpu, 2, roof)
    bw = 2 * 2e12 * 0.5                                    # 2e12 B/s over the TP group
    assert d.cost.k1 == pytest.approx(1e5 / bw)            # 5e-8 s per KV token
    assert d.cost.k2 == pytest.approx(20e9 / bw)           # 10 ms: every BF16 weight once
    assert d.cost.k3 == pytest.approx(2 * 5e9 / (2 * 1e15 * 0.5))   # 1e-5 s per sequence
    assert d.cost.k4 == 1e-3
    assert d.prefill_s_per_token == pytest.approx(2 * 5e9 / (2 * 1e15 * 0.4))
    # (2·80e9·0.9 − 20e9) / 1e5 = 1,240,000 tokens
    assert costs.kv_capacity_tokens(model, gpu, 2, roof) == 1_240_000
    with pytest.raises(ValueError, match="tp=1"):
        costs.kv_capacity_tokens(model, gpu, 1, costs.RooflineParams(kv_memory_fraction=0.2))


def test_train_step_flops():
    model = costs.ModelSpec(params=1e9, active_params=1e9, layers=2, attn_dim=100,
                            kv_bytes_per_token=1)
    gpu = costs.GpuSpec(peak_flops=1e12, hbm_bytes=1, hbm_bw=1, pcie_bw=1, nic_bw=1)
    # 6·1e9·(10+20) + 3·2·100·(100+400) = 1.8e11 + 3e5; ×4/3 with the log-prob forward
    assert costs.train_flops(model, [10, 20], logprob_forward=False) == pytest.approx(1.8e11 + 3e5)
    assert costs.train_flops(model, [10, 20], logprob_forward=True) == pytest.approx((1.8e11 + 3e5) * 4 / 3)
    p = costs.TrainParams(mfu=0.5, logprob_forward=False)
    assert costs.train_step_s(model, gpu, 4, [10, 20], p) == pytest.approx((1.8e11 + 3e5) / 2e12)


def test_weight_movement():
    p = costs.SyncParams(push_bw=100e9, hop_bw=100e9, hop_start_s=5e-6, chunk_bytes=32 * 2**20,
                         reload_s=0.3, nccl_bw=25e9, nccl_setup_s=1.0, colocated_bw=300e9)
    assert costs.publish_stall_s(64e9, p) == pytest.approx(0.64)     # Laminar: 32B → 0.64 s
    # 72B (144 GB) to 127 relays: k = 4292 chunks of 33.55 MB; (127 + 4292 − 1)·t_chunk
    k, t_chunk = costs.chain_chunk_s(144e9, p)
    assert k == 4292 and t_chunk == pytest.approx(144e9 / 4292 / 100e9 + 5e-6)
    last = costs.chain_arrival_s(144e9, 127, p)
    assert last == pytest.approx((127 + 4292 - 1) * t_chunk)
    assert 1.4 < last < 1.6                                          # Laminar Fig. 19: < 1.6 s
    assert costs.chain_arrival_s(144e9, 0, p) == 0.0
    gpu = costs.GpuSpec(peak_flops=1, hbm_bytes=1, hbm_bw=1, pcie_bw=50e9, nic_bw=1)
    assert costs.relay_pull_s(64e9, 4, gpu, p) == pytest.approx(16e9 / 50e9 + 0.3)
    assert costs.nccl_sync_s(64e9, 4, p) == pytest.approx(1.0 + 16e9 / 25e9)
    assert costs.colocated_sync_s(64e9, 4, p) == pytest.approx(16e9 / 300e9 + 0.3)


def test_profiled_cost_file(tmp_path):
    path = tmp_path / "cost_model.json"
    path.write_text(json.dumps({"k1": 1e-7, "k2": 2e-3, "k3": 1e-4, "k4": 5e-3, "k5": 1.0,
                                "prefill_s_per_token": 3e-5, "per_request_s": 1e-3}))
    d = costs.load_profiled(path)
    assert d.cost == CostModel(k1=1e-7, k2=2e-3, k3=1e-4, k4=5e-3, k5=1.0)
    assert (d.prefill_s_per_token, d.per_request_s) == (3e-5, 1e-3)
    path.write_text(json.dumps({"k1": 1e-7}))
    with pytest.raises(ValueError, match="lacks"):
        costs.load_profiled(path)


def test_colocated_memory_by_hand():
    gpu = costs.GpuSpec(peak_flops=1e15, hbm_bytes=80e9, hbm_bw=2e12, pcie_bw=50e9, nic_bw=50e9)
    model = costs.ModelSpec(params=10e9, active_params=10e9, layers=10, attn_dim=1000,
                            kv_bytes_per_token=1e5)
    roof, p = costs.RooflineParams(kv_memory_fraction=0.9), costs.ColocatedParams()

    def memory(**kw):
        args = dict(tp=2, gpus=16, fraction=0.0, offload=False, roof=roof, p=p) | kw
        return costs.colocated_memory(model, model, gpu, **args)

    # Resident: 16 B x 10e9 / 16 GPUs = 10 GB, so the engine gets 0.9 - 10/80 = 0.775.
    # Sleep level 1: 20 GB of weights / TP 2 / 50 GB/s = 0.2 s, out and back.
    assert memory() == pytest.approx((0.775, 0.4))
    # Optimizer offload: 4 B resident (2.5 GB, 0.86875 left); 12 B x 10e9 / 16 = 7.5 GB
    # at 50 GB/s is 0.15 s each way on top.
    assert memory(offload=True) == pytest.approx((0.86875, 0.7))
    # An explicit share is kept when it fits: 10 GB + 0.5 x 80 GB.
    assert memory(fraction=0.5) == pytest.approx((0.5, 0.4))
    assert costs.colocated_memory(model, model, gpu, tp=2, gpus=16, fraction=0.5, offload=False,
                                  roof=roof, p=costs.ColocatedParams(sleep_level=2)) \
        == pytest.approx((0.5, 0.0))
    # 10 GB + 0.9 x 80 GB = 82 GB does not fit an 80 GB GPU: the error names the figures.
    with pytest.raises(ValueError, match=r"10\.0 GB a GPU.*0\.90 x 80 GB.*train_offload"):
        memory(fraction=0.9)
    # On 2 GPUs the resident 80 GB leaves nothing at all.
    with pytest.raises(ValueError, match=r"80\.0 GB a GPU"):
        memory(gpus=2)


def test_colocated_memory_in_the_layout():
    import dataclasses

    from fnrl.sim.layout import layout
    from fnrl.sim.config import ClusterSpec, SimConfig

    # Qwen2.5-7B colocated on 16 H100s at TP 2: 16 · 7.6e9 / 16 = 7.6 GB resident, so the
    # engine gets 0.9 − 7.6 / 80 = 0.805 of each GPU: (2 · 80e9 · 0.805 − 15.2e9) / 57,344.
    cfg = SimConfig(preset="sync", gpus=16, plots=False,
                    cluster=ClusterSpec(model="qwen2.5-7b", placement="colocated", rollout_tp=2))
    assert layout(cfg).kv_capacity == int((2 * 80e9 * 0.805 - 15.2e9) // 57344)
    offload = dataclasses.replace(cfg.cluster, train_offload=True)
    assert layout(dataclasses.replace(cfg, cluster=offload)).kv_capacity > layout(cfg).kv_capacity
    # 72B colocated on 8 GPUs: 145 GB of state a GPU cannot stay beside any engine.
    small = dataclasses.replace(cfg, gpus=8, cluster=dataclasses.replace(
        cfg.cluster, model="qwen2.5-72b", rollout_tp=8))
    with pytest.raises(ValueError, match=r"colocated on 8 GPUs.*145\.4 GB a GPU"):
        layout(small)
    with pytest.raises(ValueError, match="train_offload"):
        ClusterSpec(train_offload=True)
    with pytest.raises(ValueError, match="memory_fraction"):
        ClusterSpec(memory_fraction=1.5)
