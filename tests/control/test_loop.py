"""The controller loop, the supervisor and recovery over fake role handles and a
virtual clock: no processes, no vLLM, no waiting on real time."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json

import numpy as np
import pytest

from fnrl.control.handles import NodeLost, RelayEvent, RoleError, Roles, ServerError
from fnrl.control.loop import Controller
from fnrl.control.metrics import MetricsWriter, plot_run
from fnrl.control.metrics import read_jsonl
from fnrl.control.report import across_attempts
from fnrl.control.supervisor import RELAY_BACKOFF_S, JobRestart
from fnrl.config import FaultInjection
from fnrl.config.presets import apply_preset
from fnrl.control.journal import records as journal_records
from fnrl.shell.files import DiskFull, SpaceReserve
from fnrl.sim.handles import LoopClock, SimRelays, run_virtual

from tests.control.fakes import FakeRollout, FakeTrainer, fake_task

STEPS, GROUPS, G = 6, 2, 4


def make_cfg(preset: str = "fnrl", *, steps: int = STEPS, inject=(), **faults):
    cfg = apply_preset(preset)
    return dataclasses.replace(
        cfg, steps=steps, eval=dataclasses.replace(cfg.eval, every=3),
        algo=dataclasses.replace(cfg.algo, group_size=G, groups_per_step=GROUPS, max_new_tokens=8),
        rollout=dataclasses.replace(cfg.rollout, num_servers=2, queued_groups=GROUPS),
        faults=dataclasses.replace(cfg.faults, trainer_hang_s=30.0, rollout_stall_s=20.0,
                                   heartbeat_timeout_s=5.0,
                                   inject=FaultInjection(kills=tuple(inject)), **faults))


def make_roles(trainer=None, relays=None, rollouts=2, **rollout_kw):
    relays = relays or SimRelays()
    trainer = trainer or FakeTrainer(relays)
    return Roles(trainer=trainer, rollouts=[FakeRollout(r, relays, **rollout_kw)
                                            for r in range(rollouts)], relays=relays)


async def _run(cfg, roles, run_dir, *, clock=None, version=0):
    writer = MetricsWriter(run_dir)
    ctl = Controller(cfg, roles, fake_task(), run_dir=run_dir, writer=writer,
                     trainer_version=version, clock=clock or LoopClock(), log=lambda s: None)
    try:
        return ctl, await ctl.run()
    finally:
        writer.close()


def run(cfg, roles, run_dir, **kw):
    return run_virtual(_run(cfg, roles, run_dir, **kw))


def consumed_groups(run_dir) -> list[str]:
    return [r["group"] for r in read_jsonl(run_dir / "trajectories.jsonl")]


def check_consumed(run_dir, eta: int, expected: int) -> None:
    """Every consumed group exactly once, every token within the bound."""
    records = read_jsonl(run_dir / "trajectories.jsonl")
    names = [r["group"] for r in records]
    assert len(names) == len(set(names)) == expected
    for r in records:
        for tr in r["trajectories"]:
            for version, n in tr["segments"]:
                assert n == 0 or version + eta >= r["consumed_version"], r


@pytest.mark.parametrize("preset", ["sync", "fnrl", "partial_rollout"])
def test_loop_trains_every_step(tmp_path, preset):
    cfg = make_cfg(preset)
    roles = make_roles()
    ctl, summary = run(cfg, roles, tmp_path)
    assert roles.trainer.version == summary["version"] == summary["steps"] == STEPS
    assert roles.trainer.trained == list(range(STEPS))
    check_consumed(tmp_path, cfg.coord.eta, STEPS * GROUPS)
    # The bound was checked on real tokens, not asserted as a constant.
    assert summary["staleness_checked_tokens"] > 0
    assert 0 <= summary["staleness_checked_max"] <= cfg.coord.eta
    assert summary["failures"] == 0 and summary["ettr"] == 1.0
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    # Every consumed trajectory names the exact prompt ids it was generated from.
    task = fake_task()
    prompts = {p.uid: p.prompt for p in task.prompts.take(4 * STEPS * GROUPS)}
    for r in read_jsonl(tmp_path / "trajectories.jsonl"):
        assert [tr["prompt_ids"] for tr in r["trajectories"]] == \
            [task.encode(prompts[r["group"]])] * G


def test_a_skipped_update_mid_run_is_survived_at_the_same_version(tmp_path):
    cfg = make_cfg("fnrl")
    relays = SimRelays()
    roles = make_roles(FakeTrainer(relays, skip_steps={3}), relays)
    ctl, summary = run(cfg, roles, tmp_path)
    # Step 3 was skipped once: version 2 was trained from twice, and the run went on.
    assert roles.trainer.trained == [0, 1, 2, 2, 3, 4]
    assert summary["skipped_updates"] == 1 and summary["steps"] == STEPS
    assert summary["version"] == STEPS - 1
    check_consumed(tmp_path, cfg.coord.eta, STEPS * GROUPS)


def test_a_killed_rollout_is_restarted_and_its_work_continues(tmp_path):
    cfg = make_cfg("fnrl", inject=["rollout1:at=3"])
    roles = make_roles(length=8, tokens_per_turn=1)
    ctl, summary = run(cfg, roles, tmp_path)
    assert roles.rollouts[1].restarts == 1
    faults = read_jsonl(tmp_path / "faults.jsonl")
    failure = [f for f in faults if f["event"] == "failure"]
    assert [(f["role"], f["decision"]) for f in failure] == [("rollout1", "RestartRole")]
    assert any(f["event"] == "recovered" and f["role"] == "rollout1" for f in faults)
    assert summary["steps"] == STEPS and summary["ettr"] < 1.0
    check_consumed(tmp_path, cfg.coord.eta, STEPS * GROUPS)


def test_a_hung_trainer_is_detected_restarted_and_the_batch_sent_again(tmp_path):
    cfg = make_cfg("fnrl")
    relays = SimRelays()
    roles = make_roles(FakeTrainer(relays, hang_steps={3}), relays)
    ctl, summary = run(cfg, roles, tmp_path)
    assert roles.trainer.restarts == 1
    assert roles.trainer.trained == list(range(STEPS))   # version 2's batch went again
    (failure,) = [f for f in read_jsonl(tmp_path / "faults.jsonl") if f["event"] == "failure"]
    assert failure["role"] == "trainer" and "no progress" in failure["reason"]
    assert summary["train_retries"] == 1 and summary["version"] == STEPS
    check_consumed(tmp_path, cfg.coord.eta, STEPS * GROUPS)


def test_a_trainer_dead_after_its_checkpoint_is_not_trained_twice(tmp_path):
    cfg = make_cfg("fnrl")
    relays = SimRelays()
    trainer = FakeTrainer(relays, die_steps={4}, checkpoint_before_death=True)
    ctl, summary = run(cfg, make_roles(trainer, relays), tmp_path)
    assert summary["steps_recovered_from_checkpoint"] == 1
    assert trainer.trained == [0, 1, 2, 4, 5]            # the step to 4 was in the checkpoint
    check_consumed(tmp_path, cfg.coord.eta, STEPS * GROUPS)


def relay1_dies(relays, clock, *, at_version: int, cause: str, seen_after_s: float):
    """A trainer during whose step `at_version` relay1 dies (once); the tier reports the
    repair `seen_after_s` after the failure."""
    class Trainer(FakeTrainer):
        async def train(self, arrays):
            if self.version == at_version and not relays.repairs:
                relays.kill("relay1")
                relays.repairs.append(RelayEvent("relay1", cause, clock.epoch() - seen_after_s,
                                                 clock.epoch(), "relay0"))
            return await super().train(arrays)
    return Trainer(relays)


def test_a_hung_relay_spliced_out_is_down_until_the_end_and_counted_a_failure(tmp_path):
    cfg = make_cfg("fnrl")
    clock = LoopClock()
    relays = SimRelays(names=("relay0", "relay1"))

    trainer = relay1_dies(relays, clock, at_version=2, cause="hung", seen_after_s=1.5)
    ctl, summary = run(cfg, make_roles(trainer, relays), tmp_path, clock=clock)
    (repair,) = [f for f in read_jsonl(tmp_path / "faults.jsonl") if f["event"] == "chain_repaired"]
    assert repair["role"] == "relay1" and repair["repair_s"] == pytest.approx(1.5)
    assert summary["ettr_units"] == 1 + 2 + 2
    # Never replaced (a hung relay keeps its place): down from its failure to the end,
    # not just for the splice's 1.5 s.
    failed_s = repair["t"] - repair["repair_s"]   # at the latest (the repair is seen late)
    wall = summary["loop_wall_s"]
    assert wall - failed_s - 1e-6 <= summary["role_down_s"] <= wall
    assert summary["role_down_s"] > 1.5 + 1e-3
    assert summary["ettr"] < 1.0 and summary["steps"] == STEPS
    (failure,) = [f for f in read_jsonl(tmp_path / "faults.jsonl") if f["event"] == "failure"]
    assert failure["role"] == "relay1" and failure["decision"] == "SpliceRelay"
    assert summary["failures"] == 1


def test_an_exited_relay_is_replaced_and_its_recovery_recorded(tmp_path):
    cfg = make_cfg("fnrl")
    clock = LoopClock()
    relays = SimRelays(names=("relay0", "relay1"), start_s=0.5)   # its replacement's start

    trainer = relay1_dies(relays, clock, at_version=2, cause="exited", seen_after_s=1.5)
    ctl, summary = run(cfg, make_roles(trainer, relays), tmp_path, clock=clock)
    assert relays.replaced == ["relay1"] and not relays.dead
    faults = read_jsonl(tmp_path / "faults.jsonl")
    (recovered,) = [f for f in faults if f["event"] == "recovered"]
    assert recovered["role"] == "relay1" and recovered["address"] == "relay1"
    assert recovered["down_s"] >= 1.5 and recovered["version"] >= 2
    # Down until the replacement served (not until the splice), and nothing else was.
    assert summary["role_down_s"] == pytest.approx(recovered["down_s"], abs=1e-6)
    assert summary["relay_recovery_s_mean"] == pytest.approx(recovered["down_s"], abs=1e-6)
    assert summary["steps"] == STEPS


@pytest.mark.parametrize("lost", [False, True])
def test_a_failed_relay_replacement_is_retried_with_backoff_and_counted(tmp_path, lost):
    """A replacement that fails is tried again, waits doubling (RELAY_TRIES tries); a
    node that is lost is not tried again. Either way the relay stays down, counted."""
    cfg = make_cfg("fnrl")
    clock = LoopClock()
    relays = SimRelays(names=("relay0", "relay1"))
    tries: list[float] = []
    replace = relays.replace

    async def flaky_replace(name):
        tries.append(clock.now())
        if lost:
            raise NodeLost(f"{name}: its node is lost; no replacement")
        if len(tries) < 3:
            raise RoleError(f"{name} did not start")
        return await replace(name)

    relays.replace = flaky_replace

    trainer = relay1_dies(relays, clock, at_version=1, cause="exited", seen_after_s=0.5)
    ctl, summary = run(cfg, make_roles(trainer, relays), tmp_path, clock=clock)
    faults = read_jsonl(tmp_path / "faults.jsonl")
    failed = [f for f in faults if f["event"] == "restart_failed"]
    recovered = [f for f in faults if f["event"] == "recovered"]
    if lost:
        assert len(tries) == 1 and [f["final"] for f in failed] == [True]
        assert not recovered and relays.replaced == []
        # Down from its failure to the end: it was never replaced.
        assert summary["role_down_s"] > summary["loop_wall_s"] - tries[0] - 1e-6
    else:
        assert len(tries) == 3 and [f["attempt"] for f in failed] == [1, 2]
        gaps = np.diff(tries)
        # Virtual time: each wait is its backoff exactly (to float rounding).
        assert gaps == pytest.approx([RELAY_BACKOFF_S, 2 * RELAY_BACKOFF_S])
        (done,) = recovered
        assert relays.replaced == ["relay1"] and done["down_s"] >= gaps.sum()
        assert summary["role_down_s"] == pytest.approx(done["down_s"], abs=1e-6)
    assert summary["failures"] == 1


def test_a_hung_relay_is_spliced_out_but_not_replaced(tmp_path):
    relays = SimRelays(names=("relay0", "relay1"))
    relays.repairs.append(RelayEvent("relay1", "hung", 0.0, 1.0, "relay0"))
    run(make_cfg("fnrl"), make_roles(FakeTrainer(relays), relays), tmp_path)
    assert relays.replaced == []
    assert not [f for f in read_jsonl(tmp_path / "faults.jsonl") if f["event"] == "recovered"]


def test_an_injection_naming_a_missing_role_is_refused(tmp_path):
    cfg = make_cfg("fnrl", inject=["rollout5:at=3"])
    with pytest.raises(ValueError, match="rollout5"):
        run(cfg, make_roles(), tmp_path)


def test_a_rollout_failing_in_its_first_step_restarts_the_job(tmp_path):
    cfg = make_cfg("fnrl")
    relays = SimRelays()
    roles = make_roles(relays=relays)
    roles.rollouts[0] = FakeRollout(0, relays, die_after_tokens=3)   # before it finished one
    with pytest.raises(JobRestart, match="first step"):
        run(cfg, roles, tmp_path)
    end = [r for r in read_jsonl(tmp_path / "attempts.jsonl") if r["event"] == "end"]
    assert end and end[-1]["job_restart"]


def test_a_twice_failed_restart_restarts_the_job(tmp_path):
    cfg = make_cfg("fnrl", inject=["rollout1:at=3"])
    roles = make_roles()

    async def failing_restart():
        raise ServerError("rollout1 did not start")

    roles.rollouts[1].restart = failing_restart
    with pytest.raises(JobRestart, match="failed to restart"):
        run(cfg, roles, tmp_path)
    failed = [f for f in read_jsonl(tmp_path / "faults.jsonl") if f["event"] == "restart_failed"]
    assert len(failed) == cfg.faults.max_restart_failures + 1


async def _run_until(cfg, roles, run_dir, version: int):
    """Runs a controller until the trainer reaches `version`, then kills it (the task
    is cancelled between two steps of the event loop, as a SIGKILL would stop it)."""
    task = asyncio.ensure_future(_run(cfg, roles, run_dir, version=roles.trainer.version))
    while roles.trainer.version < version and not task.done():
        await asyncio.sleep(0.001)   # virtual time: the roles' work takes some
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_controller_killed_twice_with_a_torn_journal_resumes_exactly_once(tmp_path):
    cfg = make_cfg("fnrl", steps=9)
    relays = SimRelays()
    trainer = FakeTrainer(relays)
    run_virtual(_run_until(cfg, make_roles(trainer, relays), tmp_path, 3))
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"ev": "fill", "problem": {"uid"')          # a crash mid-write
    run_virtual(_run_until(cfg, make_roles(trainer, relays), tmp_path, 6))
    ctl, summary = run(cfg, make_roles(trainer, relays), tmp_path, version=trainer.version)
    assert trainer.version == 9 and trainer.trained == list(range(9))
    check_consumed(tmp_path, cfg.coord.eta, 9 * GROUPS)
    # No fused records: every line is one framed record (no torn tail, no damage).
    assert len(journal_records(tmp_path / "journal.jsonl")) == len(
        (tmp_path / "journal.jsonl").read_text().splitlines())
    total = across_attempts(tmp_path)
    assert total["attempts"] == 3 and total["killed_attempts"] == 2
    assert total["consumed_groups_all"] == 9 * GROUPS
    assert total["train_records_all"] == 9
    assert plot_run(tmp_path).exists()


def _a_record_with_a_later_one_of_its_live_trajectory(path):
    """Offset of a tokens record whose trajectory has tokens before it, records after it,
    and is still live (not dropped) at the end of the pool's log: damage there breaks
    that trajectory, which then has tokens to discard."""
    from fnrl.data.partial_pool import _decode

    data, pos, seen = path.read_bytes(), 0, []
    while (rec := _decode(data, pos)) is not None:
        seen.append((pos, rec[0]))
        pos = rec[1]
    dropped = {r["uid"] for _, r in seen if r["op"] == "drop"}
    for i, (offset, r) in enumerate(seen):
        later = [x for _, x in seen[i + 1:] if x["uid"] == r["uid"]]
        earlier = [x for _, x in seen[:i] if x["uid"] == r["uid"] and x["op"] == "tokens"]
        if r["op"] == "tokens" and later and earlier and r["uid"] not in dropped:
            return offset, r["uid"]
    raise AssertionError("no live trajectory with two records in the pool")


def test_a_pool_damaged_in_the_middle_regenerates_only_what_the_damage_broke(tmp_path):
    cfg = make_cfg("fnrl", steps=8)
    relays = SimRelays()
    trainer = FakeTrainer(relays)
    roles = make_roles(trainer, relays, length=8, tokens_per_turn=1)
    run_virtual(_run_until(cfg, roles, tmp_path, 3))
    pool_log = tmp_path / "partial_responses.log"
    offset, uid = _a_record_with_a_later_one_of_its_live_trajectory(pool_log)
    data = bytearray(pool_log.read_bytes())
    data[offset + 12:offset + 28] = b"\xff" * 16
    pool_log.write_bytes(bytes(data))
    ctl, summary = run(cfg, make_roles(trainer, relays, length=8, tokens_per_turn=1), tmp_path,
                       version=trainer.version)
    assert trainer.version == 8 and trainer.trained == list(range(8))
    check_consumed(tmp_path, cfg.coord.eta, 8 * GROUPS)   # every group once, none lost
    assert summary["recovery_pool_damaged_bytes"] > 0
    assert summary["recovery_pool_discarded_trajectories"] == 1   # the one it broke
    assert summary["recovery_pool_discarded_tokens"] > 0
    assert (tmp_path / "partial_responses.log.damaged").exists()
    # The trajectory the damage broke was generated again from its prompt: what its
    # group trained on holds no token of the damaged record's version... and is whole.
    trained = [t for r in read_jsonl(tmp_path / "trajectories.jsonl") for t in r["trajectories"]
               if t["uid"] == uid]
    assert len(trained) == 1 and sum(n for _, n in trained[0]["segments"]) == 8


def test_recovery_discards_tokens_too_stale_for_the_bound_and_journals_them(tmp_path):
    cfg = make_cfg("fnrl", steps=12)
    relays = SimRelays()
    trainer = FakeTrainer(relays)
    run_virtual(_run_until(cfg, make_roles(trainer, relays, length=8, tokens_per_turn=1),
                           tmp_path, 2))
    # The trainer moved on while no controller ran (another job trained it, say): what
    # was streamed on versions <= 2 is now older than the bound allows.
    trainer.version = 2 + cfg.coord.eta + 2
    relays.published.append(trainer.version)
    ctl, summary = run(cfg, make_roles(trainer, relays), tmp_path, version=trainer.version)
    discarded = [u for r in journal_records(tmp_path / "journal.jsonl") if r["ev"] == "discard"
                 for u in r["uids"]]
    assert discarded and summary["recovery_discarded_tokens"] > 0
    # A discarded group starts again from its prompt: what it trains on is all new.
    again = [(v, n) for r in read_jsonl(tmp_path / "trajectories.jsonl") for t in r["trajectories"]
             if t["uid"] in discarded for v, n in t["segments"]]
    assert again and min(v for v, _ in again) >= 2 + cfg.coord.eta + 2
    check_consumed(tmp_path, cfg.coord.eta, len(consumed_groups(tmp_path)))


def test_the_run_ends_after_the_restarts_under_way(tmp_path):
    cfg = make_cfg("fnrl", inject=[f"rollout1:at={STEPS - 1}"])
    roles = make_roles(length=8, tokens_per_turn=1)
    slow = roles.rollouts[1]
    quick_restart = slow.restart

    async def slow_restart():
        await asyncio.sleep(60.0)          # virtual: longer than the rest of the run
        return await quick_restart()

    slow.restart = slow_restart
    ctl, summary = run(cfg, roles, tmp_path)
    events = read_jsonl(tmp_path / "faults.jsonl")
    (recovered,) = [e for e in events if e["event"] == "recovered" and e["role"] == "rollout1"]
    assert recovered["t"] > summary["loop_wall_s"]   # still under way when the steps ended
    assert slow.restarts == 1 and summary["steps"] == STEPS


@pytest.mark.parametrize("where", ["metrics", "trainer"])
def test_a_full_disk_stops_the_attempt_cleanly_with_an_end_record(tmp_path, monkeypatch, where):
    """ENOSPC in the controller's own writes, or a trainer that could not log its batch:
    a DiskFull naming the run's disk, an `end` record (not a killed attempt), the logs
    closed whole and the space reserve given back."""
    relays = SimRelays()
    trainer = FakeTrainer(relays)
    if where == "metrics":
        write = MetricsWriter.write

        def full_at_step_3(self, kind, step, values):
            if kind == "train" and step == 3:
                raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")
            return write(self, kind, step, values)
        monkeypatch.setattr(MetricsWriter, "write", full_at_step_3)
    else:
        train = trainer.train

        async def full_at_version_2(arrays):
            if trainer.version == 2:
                raise DiskFull("trainer was writing", tmp_path, "[Errno 28] No space left")
            return await train(arrays)
        trainer.train = full_at_version_2
    with pytest.raises(DiskFull, match=f"no space left on the device of {tmp_path}"):
        run(make_cfg("fnrl"), make_roles(trainer, relays), tmp_path)
    (end,) = [r for r in read_jsonl(tmp_path / "attempts.jsonl") if r["event"] == "end"]
    assert "no space left" in end["disk_full"] and end["steps"] in (2, 3)
    assert across_attempts(tmp_path)["killed_attempts"] == 0
    assert not (tmp_path / SpaceReserve.NAME).exists()
    journal_records(tmp_path / "journal.jsonl")   # whole: reads without a damaged record
    assert (tmp_path / "timeline.json").exists()


def test_a_finished_run_gives_its_space_reserve_back(tmp_path):
    run(make_cfg("fnrl", steps=2), make_roles(), tmp_path)
    assert not (tmp_path / SpaceReserve.NAME).exists()
