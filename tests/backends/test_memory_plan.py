"""The job's memory plan: figures by hand for every role, and the check that names them."""

import dataclasses

import pytest

from fnrl.config import (FaultConfig, LoraConfig, RelayConfig, RolloutConfig, RunConfig,
                         TrainerConfig)
from fnrl.backends.memory import (CONTROLLER_BYTES, RELAY_PROCESS_BYTES, check_plan,
                                 plan_memory, trainer_batch_shape)
from fnrl.serving.server import SERVER_PROCESS_BYTES
from fnrl.models.decoder import DecoderConfig
from fnrl.trainer.memory import param_count, trainer_memory

TINY = DecoderConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                     tie_word_embeddings=True)
N = 2024   # its parameters, counted by hand in tests/trainer/test_trainer_memory.py


def _cfg(**kw) -> RunConfig:
    return RunConfig(rollout=RolloutConfig(num_servers=2, max_num_seqs=4, serve_dtype="bfloat16"),
                     relay=RelayConfig(num_relays=2, keep_versions=2, inbox_slots=2),
                     trainer=TrainerConfig(length_buckets=(8, 64)), **kw)


def test_every_role_by_hand():
    assert param_count(TINY) == N
    cfg = _cfg()
    plan = plan_memory(TINY, cfg, context_len=8)
    roles = {r.role: r for r in plan.roles}
    assert list(roles) == ["trainer", "relay0", "relay1", "server0", "server1", "eval",
                           "controller"]   # eval: the dedicated evaluation server
    # The trainer's largest batch: all its rows at the longest bucket within the context.
    assert trainer_batch_shape(cfg, 8) == (cfg.batch_size, 8)
    assert trainer_batch_shape(cfg, 100) == (cfg.batch_size, 64)
    assert roles["trainer"].peak_bytes == trainer_memory(
        TINY, cfg.trainer, cfg.algo, rows=cfg.batch_size, length=8,
        serve_dtype="bfloat16").peak_bytes
    version = 2 * N   # bfloat16 weights
    assert roles["relay0"].peak_bytes == 3 * version + 2 * version + RELAY_PROCESS_BYTES
    assert roles["relay1"].peak_bytes == 3 * version + RELAY_PROCESS_BYTES
    # KV: 2 layers x (K, V) x 1 kv head x 4 dims x 2 bytes = 32 bytes a token; 4 sequences
    # of one 128-token block, + 10% rounded up = 5, + vLLM's null block = 6 blocks.
    # On CPU a server holds 3 copies of its weights at its peak (SERVER_WEIGHT_COPIES).
    assert dict(roles["server0"].items) == {"weights (bfloat16) x 3": 3 * version,
                                            "KV 4 seqs x 8 tokens": 6 * 128 * 32,
                                            "process": SERVER_PROCESS_BYTES}
    assert roles["controller"].peak_bytes == CONTROLLER_BYTES
    assert plan.total_bytes == sum(r.peak_bytes for r in plan.roles)
    table = plan.table()
    assert "relay0" in table and "KV 4 seqs x 8 tokens" in table and "total" in table


def test_a_standby_doubles_the_trainer_and_gpu_kv_is_not_host_memory():
    plan = plan_memory(TINY, _cfg(faults=FaultConfig(trainer_standby=True)), context_len=8,
                       kv_in_host=False)
    roles = {r.role: r for r in plan.roles}
    assert roles["standby"].peak_bytes == roles["trainer"].peak_bytes
    assert dict(roles["server1"].items)["KV 4 seqs x 8 tokens"] == 0
    assert dict(roles["server1"].items)["weights (bfloat16) x 1"] == 2 * N


def test_kv_memory_fraction_takes_its_share_of_node_0():
    cfg = dataclasses.replace(_cfg(), rollout=RolloutConfig(num_servers=1, kv_memory_fraction=0.25))
    with pytest.raises(ValueError, match="node_total_bytes"):
        plan_memory(TINY, cfg, context_len=8)
    plan = plan_memory(TINY, cfg, context_len=8, node_total_bytes=8 * 2**30)
    assert {r.role: r.peak_bytes for r in plan.roles}["server0"] == 2 * 2**30


def test_the_check_names_every_figure_when_it_does_not_fit():
    plan = plan_memory(TINY, _cfg(), context_len=8)
    check_plan(plan, available_bytes=plan.total_bytes)   # exactly enough
    with pytest.raises(ValueError) as err:
        check_plan(plan, available_bytes=plan.total_bytes - 1)
    msg = str(err.value)
    for r in plan.roles:
        assert r.role in msg
        for what, _ in r.items:
            assert what in msg
    assert "--trainer.logprob-chunk" in msg


def test_a_multi_node_plan_is_checked_per_machine():
    from fnrl.backends.memory import MemoryPlan, RoleMemory, check_plan_per_machine
    gib = 1 << 30
    plan = MemoryPlan(roles=tuple(RoleMemory(role=name, items=(("x", b * gib),),
                                             peak_bytes=b * gib)
                                  for name, b in (("trainer", 10), ("relay0", 2), ("server0", 6),
                                                  ("server1", 6), ("controller", 1))))
    placed = {"trainer": "10.0.0.1", "relay0": "10.0.0.1", "server0": "10.0.0.2",
              "server1": "10.0.0.2", "controller": None}
    check_plan_per_machine(plan, placed, {"10.0.0.1": 12 * gib, "10.0.0.2": 12 * gib})
    # Logical nodes on one machine share its memory: the same roles do not fit on 20 GiB.
    one = {k: (None if v is None else "127.0.0.1") for k, v in placed.items()}
    with pytest.raises(ValueError, match=r"127\.0\.0\.1 needs 24\.00 GiB for trainer 10\.00, "
                                         r"relay0 2\.00, server0 6\.00, server1 6\.00 but has "
                                         r"20\.00 GiB available"):
        check_plan_per_machine(plan, one, {"127.0.0.1": 20 * gib})


def test_with_lora_relays_hold_adapters_and_servers_the_base_they_merge_into():
    lora = LoraConfig(rank=2, targets=("q_proj", "down_proj"))
    cfg = dataclasses.replace(_cfg(), trainer=TrainerConfig(length_buckets=(8, 64), lora=lora))
    roles = {r.role: r for r in plan_memory(TINY, cfg, context_len=8).roles}
    version = 2 * 160   # bfloat16 adapters (tests/trainer/test_trainer_memory.py)
    assert roles["relay1"].peak_bytes == 3 * version + RELAY_PROCESS_BYTES
    assert dict(roles["server0"].items)["LoRA base of the adapted projections"] == 2 * 384


def test_the_disk_plan_counts_checkpoints_batches_and_logs_and_refuses_by_name():
    from fnrl.backends.memory import check_disk, plan_disk

    cfg = dataclasses.replace(_cfg(), steps=10)
    items = dict(plan_disk(TINY, cfg, context_len=8))
    state = 3 * 4 * N   # params and Adam's two moments, float32
    assert items["2 checkpoints + 1 being written"] == 3 * state
    rows = cfg.batch_size
    assert items[f"batch log (2 batches of {rows} x 8)"] == 2 * rows * 8 * 8 * 4
    check_disk(tuple(items.items()), 2**40, "/runs/a")
    with pytest.raises(ValueError) as err:
        check_disk(tuple(items.items()), 2**20, "/runs/a")
    assert "/runs/a" in str(err.value) and "--trainer.checkpoint-keep" in str(err.value)
    assert "0.00 GiB is free" in str(err.value)
