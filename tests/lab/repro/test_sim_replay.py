"""Roles sharing a host's cores (ClusterSpec.shared_cores), and the replay of this
machine's presets benchmark (lab.repro.replay)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from fnrl.config import CostModel
from fnrl.sim import costs
from fnrl.sim.cluster import Simulation
from lab.repro import reproduce
from lab.repro import replay, replay_data
from fnrl.sim.workload import WorkloadSpec, group_lengths

from tests.sim.toy import TOY, toy_cfg


def shared(cfg, cores, **cluster):
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, shared_cores=cores,
                                                                **cluster))


def events(sim):
    return [(e["event"], round(e["t0"], 9), round(e["t"], 9)) for e in sim.timeline if "event" in e]


def test_sync_never_shares_a_core():
    """Sync's trainer and rollout take turns: one core is enough for the hand-worked
    schedule of tests/sim/test_sim.py to stand unchanged."""
    sim = Simulation(shared(toy_cfg(), 1), table=TOY)
    assert sim.run()["train_wall_s"] == pytest.approx(10.5)
    assert events(sim) == [("train", 3.8, 5.0), ("pull", 5.0, 5.5), ("train", 9.3, 10.5)]


def test_host_load_slows_only_what_shares_a_core_with_it_by_hand():
    """cluster.host_load: cores taken by processes the simulator does not run, while a
    rollout generates. Sync's toy schedule (a batch 3.8 s, a train 1.2 s, a pull 0.5 s):
    on one core a load of 1 halves the rollout (3.8 → 7.6 s; trains 7.6–8.8, pull to
    9.3, the next batch to 16.9, train to 18.1) and a load of 0.5 slows it 1.5×
    (5.7 s: trains at 5.7 and 13.1); the trainer steps alone at its own speed. On two
    cores the load and the rollout fit: 10.5, as without it."""
    def run(cores, load):
        sim = Simulation(shared(toy_cfg(), cores, host_load=load), table=TOY)
        return sim.run()["train_wall_s"], events(sim)

    assert run(1, 1.0) == (pytest.approx(18.1), [("train", 7.6, 8.8), ("pull", 8.8, 9.3),
                                                 ("train", 16.9, 18.1)])
    assert run(1, 0.5) == (pytest.approx(14.3), [("train", 5.7, 6.9), ("pull", 6.9, 7.4),
                                                 ("train", 13.1, 14.3)])
    assert run(2, 1.0)[0] == pytest.approx(10.5)
    cluster = toy_cfg().cluster
    with pytest.raises(ValueError, match="host_load"):
        dataclasses.replace(cluster, host_load=0.5)              # no shared host
    with pytest.raises(ValueError, match="host_load"):
        dataclasses.replace(cluster, shared_cores=2, corun=str(replay.CORUN), host_load=0.5)
    with pytest.raises(ValueError, match="host_load"):
        dataclasses.replace(cluster, shared_cores=2, host_load=-1.0)


def test_one_core_shared_by_trainer_and_rollout_by_hand():
    """one_step, 3 steps, everything on one core (own devices: trains end at 5.8, 7.0, 11.3).

    t=5.8  Consume v1 (1.2 s alone); the rollout pulls v1 (not busy) until 6.3
    t=6.3  groups 4, 5 queue on the rollout: 2 busy roles on 1 core, each at half speed:
           the step's 0.7 s left takes 1.4 s (ends 7.7); prefill 8 × 0.1 × 2 = 1.6 s (7.9)
    t=7.7  the trainer is done: the rollout alone, 3 steps of 1 s from 7.9: 10.9
    t=10.9 Consume v2 and a pull (to 11.4); then groups 6, 7 queue: 0.7 s left → 12.8."""
    cfg = dataclasses.replace(toy_cfg("one_step"), steps=3)
    sim = Simulation(shared(cfg, 1), table=TOY)
    summary = sim.run()
    assert events(sim) == [("train", 4.6, 5.8), ("pull", 5.8, 6.3), ("train", 5.8, 7.7),
                           ("pull", 10.9, 11.4), ("train", 10.9, 12.8)]
    assert summary["train_wall_s"] == pytest.approx(12.8)
    own = Simulation(cfg, table=TOY).run()
    assert own["train_wall_s"] == pytest.approx(11.3)
    assert Simulation(shared(cfg, 2), table=TOY).run()["train_wall_s"] == pytest.approx(11.3)


def one_step_on_one_core(**cluster):
    """one_step's 3 toy steps with every role on one core and `cluster` changed: the
    simulation after its run, and its summary."""
    cfg = dataclasses.replace(toy_cfg("one_step"), steps=3)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, shared_cores=1,
                                                               **cluster))
    sim = Simulation(cfg, table=TOY)
    return sim, sim.run()


def test_a_two_thread_trainer_on_one_core_by_hand():
    """The same schedule with the trainer on 2 threads (cluster.trainer_threads): alone it
    steps at its own speed; beside the busy rollout 3 threads share the core, so the
    rollout runs at a third of its speed and the trainer at 2/3 of its own (1.5×).

    t=6.3  the step's 0.7 s left takes 1.05 s (ends 7.35); prefill 8 × 0.1 × 3 = 2.4 s (8.7)
    t=7.35 the trainer is done: the rollout alone, 3 steps of 1 s from 8.7: 11.7
    t=11.7 Consume v2 and a pull (to 12.2); then 0.7 s left × 1.5 → 13.25."""
    sim, summary = one_step_on_one_core(trainer_threads=2)
    assert events(sim) == [("train", 4.6, 5.8), ("pull", 5.8, 6.3), ("train", 5.8, 7.35),
                           ("pull", 11.7, 12.2), ("train", 11.7, 13.25)]
    assert summary["train_wall_s"] == pytest.approx(13.25)
    with pytest.raises(ValueError, match="trainer_threads"):
        dataclasses.replace(sim.cfg.cluster, trainer_threads=0)


def corun_file(tmp_path, trainer: float, server: float) -> str:
    """A co-run table as lab/benchmarks/corun.py writes it, for one server."""
    path = tmp_path / "corun.json"
    path.write_text(json.dumps({"trainer_slowdown": {"1": {"slowdown": trainer}},
                                "server_slowdown": {"1": {"slowdown": 1.0},
                                                    "1+trainer": {"slowdown": server}}}))
    return str(path)


def test_a_measured_corun_table_on_one_core_by_hand(tmp_path):
    """The same schedule with a co-run table (ClusterSpec.corun) in place of the share:
    the trainer's step beside the generating rollout takes 3× its time, the rollout's
    decode keeps its speed.

    t=6.3  the step's 0.7 s left takes 2.1 s (ends 8.4); prefill 0.8 s, 3 steps of 1 s: 10.1
    t=10.1 Consume v2 and a pull (to 10.6); then groups 6, 7 queue: 0.7 s left × 3 → 12.7."""
    sim, summary = one_step_on_one_core(corun=corun_file(tmp_path, 3.0, 1.0))
    assert events(sim) == [("train", 4.6, 5.8), ("pull", 5.8, 6.3), ("train", 5.8, 8.4),
                           ("pull", 10.1, 10.6), ("train", 10.1, 12.7)]
    assert summary["train_wall_s"] == pytest.approx(12.7)
    with pytest.raises(ValueError, match="needs shared_cores"):
        dataclasses.replace(sim.cfg.cluster, shared_cores=0)


def test_corun_tables_that_do_not_fit_are_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"trainer_slowdown": {"2": {"slowdown": 2.0}},
                                "server_slowdown": {"1+trainer": {"slowdown": 1.0}}}))
    with pytest.raises(ValueError, match="needs the trainer beside 1..N servers"):
        costs.load_corun(path)
    path.write_text(json.dumps({"trainer": 2.0}))
    with pytest.raises(ValueError, match="not lab/benchmarks/corun.py's table"):
        costs.load_corun(path)
    table = costs.load_corun(corun_file(tmp_path, 3.0, 1.2))
    assert (table.trainer_factor(0), table.trainer_factor(1), table.trainer_factor(4)) == (
        1.0, 3.0, 3.0)     # more servers than measured: the most measured
    assert (table.server_factor(1, False), table.server_factor(2, True)) == (1.0, 1.2)


def test_a_decode_profiled_beside_another_server_by_hand(tmp_path):
    """A cost file profiled with 2 servers generating side by side (`profile_cost
    --servers 2`, engine.servers) costs one server beside another. Sync's toy schedule
    (a batch 3.8 s: prefill 8 × 0.1 s, 3 steps of 1 s) has one rollout: on one core
    the thread share gives it the core the two profiled servers shared, twice their
    share (a batch 1.9 s: trains 1.9–3.1, pull to 3.6, the next batch to 5.5, train to
    6.7); a co-run table that measured two servers 2× slower than one does the same. On
    two cores each profiled server had a core of its own: 10.5, as profiled alone."""
    def cost_file(servers):
        path = tmp_path / f"decode{servers}.json"
        path.write_text(json.dumps({"k1": 0.0, "k2": 0.0, "k3": 0.0, "k4": 1.0, "k5": 1.0,
                                    "prefill_s_per_token": 0.1, "engine": {"servers": servers}}))
        return str(path)

    def run(cores, servers, **cluster):
        sim = Simulation(shared(toy_cfg(), cores, decode=cost_file(servers), **cluster),
                         table=TOY)
        return sim.run()["train_wall_s"], events(sim)

    halved = (pytest.approx(6.7), [("train", 1.9, 3.1), ("pull", 3.1, 3.6), ("train", 5.5, 6.7)])
    assert run(1, 2) == halved
    corun = tmp_path / "corun2.json"
    corun.write_text(json.dumps({
        "trainer_slowdown": {"1": {"slowdown": 1.0}, "2": {"slowdown": 1.0}},
        "server_slowdown": {k: {"slowdown": v} for k, v in (
            ("1", 1.0), ("1+trainer", 1.0), ("2", 2.0), ("2+trainer", 2.0))}}))
    assert run(1, 2, corun=str(corun)) == halved
    assert run(2, 2)[0] == pytest.approx(10.5)
    assert run(1, 1)[0] == pytest.approx(10.5)
    assert costs.load_profiled(cost_file(2)).servers == 2
    with pytest.raises(ValueError, match="engine.servers=0"):
        costs.load_profiled(cost_file(0))


def test_train_calls_by_length_bucket():
    """ClusterSpec.train_bucket_s: the smallest bucket holding the batch's longest
    sequence; its first use costs `first`, later ones `steady`; the publish stall is paid
    after the step, so the step itself is the call less it."""
    cfg = toy_cfg()
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, train_bucket_s=((64, 0.5, 1.5), (128, 0.9, 2.0)), publish_s=0.25))
    sim = Simulation(cfg, table=TOY)
    assert sim.bucket_call_s(64) == pytest.approx((1.25, 1.0))     # first use of 64
    assert sim.bucket_call_s(10) == pytest.approx((0.25, 0.0))     # 64 again: steady
    assert sim.bucket_call_s(65) == pytest.approx((1.75, 1.1))     # 128, first
    assert sim.bucket_call_s(999) == pytest.approx((0.65, 0.0))    # past the last: 128
    for bad in (((64, 0.5, 0.4),), ((128, 1.0, 1.0), (64, 0.5, 0.5)), ((64, 0.5),)):
        with pytest.raises(ValueError, match="train_bucket_s"):
            dataclasses.replace(cfg.cluster, train_bucket_s=bad)
    # Each step of a run costs by its own batch (every toy batch fits the one bucket).
    cfg = dataclasses.replace(cfg, steps=3, cluster=dataclasses.replace(
        cfg.cluster, train_bucket_s=((10**6, 1.0, 1.5),), publish_s=0.0))
    sim = Simulation(cfg, table=TOY)
    sim.run()
    assert [r["train_step_s"] for r in sim.step_records] == pytest.approx([1.5, 1.0, 1.0])


def test_the_measured_record_holds_every_cell():
    data = replay_data.load()
    rounds = replay_data.rounds(data)
    assert len(rounds) >= 3
    for preset in replay.PRESETS:
        for r in rounds:
            cell = data["cells"][f"{preset}/{r}"]
            assert cell["steps"] == replay.STEPS and len(cell["train_call_s"]) == replay.STEPS
            assert len(cell["groups"]) >= replay.STEPS * replay.GROUPS
            assert all(len(g) == replay.GROUP_SIZE for g in cell["groups"].values())
            assert all(1 <= n <= replay.LEN_MAX for g in cell["groups"].values() for n in g)
            # Every trained token is in a recorded group.
            assert sum(map(sum, cell["groups"].values())) == cell["trained_tokens"]


def test_replay_inputs_from_the_measured_runs():
    data = replay_data.load()
    sync = [c for c in data["cells"].values() if c["preset"] == "sync"]
    assert replay.train_call_s() == pytest.approx(
        statistics.median(statistics.fmean(c["train_call_s"]) for c in sync))
    generate = statistics.median(c["rl_wall_s"] for c in sync) / replay.STEPS - replay.train_call_s()
    longest = replay.sync_longest()
    assert 100 < longest <= replay.LEN_MAX
    assert replay.decode_step_s() * longest == pytest.approx(
        generate - replay.pull_s() - replay.TICK_S)
    d = costs.load_profiled(replay.cost_file())
    assert (d.cost.k1, d.cost.k2, d.cost.k3, d.servers) == (0.0, 0.0, 0.0, replay.SERVERS)
    assert d.cost.k4 == pytest.approx(replay.decode_step_s())
    # Seed s replays round s group by group; an unrecorded group is one of the round's.
    spec = replay.workload("one_step")
    r1 = data["cells"][f"one_step/{replay_data.rounds(data)[1]}"]["groups"]
    first = sorted(r1, key=int)[3]
    assert group_lengths(spec, 1, 3, 0.0).tolist() == r1[first]
    beyond = group_lengths(spec, 1, 10_000, 0.0).tolist()
    assert beyond in list(r1.values())
    assert replay.measured_ratio("fnrl") == round(
        statistics.median(replay_data.ratios_to(data, "fnrl")), 2)


def test_the_replayed_coordinator_plans_as_the_benchmark_s_did(monkeypatch):
    """The benchmark's cells name no cost file, so their coordinator planned with
    CostModel's defaults, whatever the servers' decode; the replay's does the same."""
    runs = replay.setup(quick=True).runs
    sims = {k: r for k, r in runs.items() if not callable(r)}
    assert {"fnrl", "fnrl_served", "threads:fnrl@1thread"} <= set(sims)
    for key, cfg in sims.items():
        assert costs.load_profiled(cfg.coord_cost).cost == CostModel(), key
    assert costs.load_profiled(sims["fnrl_served"].cluster.decode).cost != CostModel()
    data = replay_data.load()
    cells = dict(data["cells"])
    cells["sync/x"] = {**cells[next(k for k in cells if k.startswith("sync/"))],
                       "coord_cost": {**dataclasses.asdict(CostModel()), "k4": 1.0}}
    monkeypatch.setattr(replay, "measured", lambda which="presets": {**data, "cells": cells})
    with pytest.raises(ValueError, match="sync's cells hold 2 coordinator cost models"):
        replay.coord_cost_file("sync")


def test_the_trainer_threads_runs_take_their_own_sync():
    data = replay_data.load(replay_data.THREADS_MEASURED)
    keys = {c["preset"] for c in data["cells"].values()}
    assert keys == {"sync", "fnrl", "sync@1thread", "fnrl@1thread"}
    assert {c["trainer_threads"] for c in data["cells"].values()} == {0, 1}
    runs = replay.setup(quick=True).runs
    one, two = runs["threads:fnrl@1thread"].cluster, runs["threads:fnrl"].cluster
    assert (one.trainer_threads, two.trainer_threads) == (1, replay.TRAINER_THREADS)
    publish = replay.publish_s("threads")
    assert one.train_step_s == pytest.approx(replay.train_call_s("threads", "sync@1thread") - publish)
    assert two.train_step_s == pytest.approx(replay.train_call_s("threads") - publish)
    assert runs["threads:fnrl@1thread"].workload.recorded == replay.recorded("fnrl@1thread", "threads")


def test_recorded_workload_says_what_is_wrong():
    with pytest.raises(ValueError, match="recorded"):
        WorkloadSpec(group_size=2, response="recorded")
    with pytest.raises(ValueError, match="group_size=2"):
        WorkloadSpec(group_size=2, response="recorded", recorded=(((1, 2), (3, 4, 5)),))
    spec = WorkloadSpec(group_size=2, response="recorded", recorded=(((1, 2),), ((7, 8), (9, 9))))
    assert group_lengths(spec, 0, 0, 0.0).tolist() == [1, 2]
    assert group_lengths(spec, 3, 1, 0.0).tolist() == [9, 9]   # seed 3: the second run


def test_replay_data_reads_a_run_directory(tmp_path):
    run = tmp_path / "preset=sync__seed=4"
    run.mkdir()
    cost = {"k1": 1e-7, "k2": 2e-3, "k3": 1e-4, "k4": 1e-2, "k5": 1.0}
    (run / "config.json").write_text(json.dumps({"preset": "sync", "seed": 4, "steps": 2,
                                                 "coord": {"cost": cost, "cost_file": ""}}))
    (run / "summary.json").write_text(json.dumps({
        "trained_tokens_per_s": 10.0, "rl_wall_s": 2.0, "trained_tokens": 7,
        "trainer_idle_frac": 0.5, "rollout_idle_frac": 0.4, "interrupted": 0,
        "reprefill_tokens": 0}))
    step = {"kind": "train", "time/train_s": 0.4, "time/publish_s": 0.01, "pulls": 4}
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"kind": "eval", "step": 0},
        {**step, "step": 1, "time/train_call_s": 0.5, "time/pull_s": 0.1, "batch_length": 64},
        {**step, "step": 2, "time/train_call_s": 1.25, "time/pull_s": 0.2,
         "batch_length": 64})) + "\n")
    groups = [{"group": "train-1", "trajectories": [
                  {"prompt_ids": [1, 2, 3], "segments": [[0, 2], [1, 1]]},
                  {"prompt_ids": [1, 2, 3], "segments": [[0, 1]]}]},
              {"group": "train-0", "trajectories": [
                  {"prompt_ids": [4], "segments": [[1, 3]]},
                  {"prompt_ids": [4], "segments": []}]}]
    (run / "trajectories.jsonl").write_text("\n".join(map(json.dumps, groups)) + "\n")
    (tmp_path / "preset=fnrl__seed=4").mkdir()     # started, never finished
    (tmp_path / "preset=fnrl__seed=4" / "config.json").write_text("{}")
    said = []
    data = replay_data.extract(tmp_path, log=said.append)
    assert said and "preset=fnrl__seed=4" in said[0]
    cell = data["cells"]["sync/4"]
    assert cell["train_call_s"] == pytest.approx([0.5, 0.75])
    assert cell["pull_s"] == pytest.approx(0.05)
    assert cell["groups"] == {"0": [3, 0], "1": [3, 1]}
    assert cell["prompt_len"] == {"0": 1, "1": 3}
    assert cell["batch_length"] == [64, 64]
    assert cell["coord_cost"] == cost
    # Bucket 64: a first call of 0.5 s, then a steady one of 0.75 s (the first is never
    # taken as cheaper than the steady).
    (bucket,) = replay_data.bucket_calls(data, "sync")
    assert bucket == pytest.approx((64, 0.75, 0.75))
    assert "decode" not in data
    # lab/benchmarks/presets.py --profile-decode: each round's profile is kept, and the
    # replay decodes the round on it; a round without one is named.
    profiles = tmp_path / replay_data.DECODE_PROFILES
    profiles.mkdir()
    profile = {"k1": 0.0, "k2": 1e-3, "k3": 1e-4, "k4": 2e-3, "k5": 1.0, "per_request_s": 0.0,
               "engine": {"servers": 2}, "runs": ["left out"]}
    (profiles / "seed=3.json").write_text(json.dumps(profile))
    with pytest.raises(ValueError, match=r"no profile for rounds \[4\]"):
        replay_data.extract(tmp_path, log=said.append)
    (profiles / "seed=4.json").write_text(json.dumps(profile))
    data = replay_data.extract(tmp_path, log=said.append)
    assert data["decode"] == {"4": {k: v for k, v in profile.items() if k != "runs"}}
    (run / "metrics.jsonl").write_text(json.dumps({**step, "step": 1}) + "\n")
    with pytest.raises(ValueError, match="1 train records for 2 steps"):
        replay_data.extract(tmp_path, log=said.append)


def test_replay_quick_runs(tmp_path):
    res = reproduce("replay", seeds=(0,), quick=True, out=tmp_path, log=lambda _: None)
    rows = {r["claim"]: r for r in res.rows()}
    assert set(rows) == {"fnrl × sync", "fnrl × sync, own cores", "sync, absolute",
                         "fnrl, absolute", "fnrl × sync, profiled decode",
                         "fnrl × sync, co-run table", "fnrl × sync, calls by bucket",
                         "fnrl × sync, co-run table, calls by bucket",
                         "sync, absolute, profiled decode", "fnrl, absolute, profiled decode",
                         "fnrl × sync, profiled decode, co-run table",
                         "sync, absolute, profiled decode, co-run table",
                         "fnrl, absolute, profiled decode, co-run table",
                         "fnrl × sync, profiled decode, host load",
                         "sync, absolute, profiled decode, host load",
                         "fnrl, absolute, profiled decode, host load",
                         "fnrl × sync, served decode", "sync, absolute, served decode",
                         "fnrl, absolute, served decode",
                         "fnrl × sync, served decode, co-run table",
                         "sync, absolute, served decode, co-run table",
                         "fnrl, absolute, served decode, co-run table",
                         "sync, absolute, served decode of its round (profiled rounds)",
                         "fnrl, absolute, served decode of its round (profiled rounds)",
                         "fnrl × sync, served decode of its round (profiled rounds)",
                         "sync, absolute, served decode (profiled rounds)",
                         "fnrl, absolute, served decode (profiled rounds)",
                         "fnrl × sync, served decode (profiled rounds)",
                         "fnrl × sync (trainer threads run)",
                         "sync@1thread × sync (trainer threads run)",
                         "fnrl@1thread × sync (trainer threads run)"}
    assert rows["fnrl × sync"]["paper"] == replay.measured_ratio("fnrl")
    assert rows["sync, absolute"]["paper"] == 1.0
    assert all(r["tolerance"] == 0.15 for r in rows.values())
    s = res.summaries[0]
    assert s["sync"]["steps"] == 3 and s["fnrl"]["steps"] == 3
    # The profiled runs decode with the committed profile's coefficients.
    profile = costs.load_profiled(str(replay.PROFILE)).cost
    assert s["sync_profiled"]["cost_model"]["k4"] == pytest.approx(profile.k4)
    assert s["sync_profiled"]["steps"] == 3
    # Sharing cores only slows the overlapping preset; sync takes turns.
    assert s["sync"]["trained_tokens_per_s"] == pytest.approx(s["sync_own_cores"]["trained_tokens_per_s"])
    assert s["fnrl"]["trained_tokens_per_s"] < s["fnrl_own_cores"]["trained_tokens_per_s"]
    out = json.loads(Path(tmp_path / "replay" / "repro.json").read_text())
    assert len(out["rows"]) == 31
    assert s["sync_profiled_load"]["trained_tokens_per_s"] < s["sync_profiled"]["trained_tokens_per_s"]
    # The derived and served decodes are one of sync's two servers side by side (the
    # served one from the committed two-server profile). With the co-run table a server
    # left alone when the other has finished its batch speeds up; thread by thread (two
    # threads on two cores) it does not.
    assert s["sync_corun"]["cost_model"]["k4"] == pytest.approx(replay.decode_step_s())
    assert s["sync_corun"]["trained_tokens_per_s"] > s["sync"]["trained_tokens_per_s"]
    served = costs.load_profiled(str(replay.SERVED))
    assert served.servers == replay.SERVERS
    assert s["sync_served"]["cost_model"]["k4"] == pytest.approx(served.cost.k4)
    # The profiled rounds: seed 0 replays the record's first round on the decode profiled
    # just before it, against that round's measured throughput.
    data = replay_data.load(replay_data.PRESETS_PROFILED)
    first = replay_data.rounds(data)[0]
    coefficients = ("k1", "k2", "k3", "k4")
    assert [s["rounds:sync"]["cost_model"][k] for k in coefficients] == pytest.approx(
        [data["decode"][str(first)][k] for k in coefficients])
    assert s["rounds:measured_fnrl"]["trained_tokens_per_s"] == pytest.approx(
        data["cells"][f"fnrl/{first}"]["trained_tokens_per_s"])
    assert s["rounds_served:sync"]["cost_model"]["k4"] == pytest.approx(served.cost.k4)
    assert s["sync_served_corun"]["trained_tokens_per_s"] > s["sync_served"]["trained_tokens_per_s"]
    # Profiled and co-run: the profile (one server alone) slowed by the table's factors.
    assert s["sync_profiled_corun"]["cost_model"]["k4"] == pytest.approx(profile.k4)
    assert s["sync_profiled_corun"]["trained_tokens_per_s"] < s["sync_profiled"]["trained_tokens_per_s"]
    # The trainer-threads run: a one-thread trainer steps alone in sync@1thread's
    # measured call, on one thread; the two-thread runs in sync's.
    one, two = s["threads:fnrl@1thread"], s["threads:fnrl"]
    assert one["steps"] == two["steps"] == 3
    assert rows["fnrl@1thread × sync (trainer threads run)"]["paper"] == replay.measured_ratio(
        "fnrl@1thread", "threads")
