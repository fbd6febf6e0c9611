"""Checkpoint save → SIGKILL → resume, with real trainer and relay processes."""

import os
import signal

import numpy as np
import pytest

from fnrl.backends.roles import Cluster
from fnrl.shell.wire import RoleClient
from fnrl.relay.client import RelayClient
from fnrl.relay.store import open_version

from tests.trainer.toy_batch import toy_batch

pytestmark = pytest.mark.slow


def _relay_weights(address: str) -> dict[str, np.ndarray]:
    with RelayClient(address) as client:
        manifest = client.latest()
        return manifest.version, {k: np.array(v) for k, v in open_version(manifest).items()}


def _start_trainer(cluster, cfg_path, model_dir, relay):
    role = cluster.start_trainer(cfg_path, model_dir, relay.address)
    client = RoleClient("trainer", role.address, role.proc, str(role.log_path))
    return role, client, client.call({"cmd": "init"}, timeout_s=300)


# every=3: no checkpoint yet when the trainer is killed at version 2; the resumed one
# replays the two logged batches from the model and must publish the same bytes.
@pytest.mark.parametrize("checkpoint_every", [1, 3])
def test_kill_and_resume_continues_at_the_right_step_with_identical_params(
        tmp_path, tiny_model_dir, write_run_config, checkpoint_every):
    run_dir = tmp_path / "run"
    cfg_path = write_run_config(run_dir, run_dir=str(run_dir),
                                trainer={"checkpoint_every": checkpoint_every})
    cluster = Cluster(run_dir)
    try:
        relay_a = cluster.start_relay("relay_a")
        cluster.wait_relay_ready(relay_a)
        role, trainer, init = _start_trainer(cluster, cfg_path, tiny_model_dir, relay_a)
        assert init["version"] == 0 and init["resumed_from"] is None
        batch = toy_batch(seq_len=16)
        for expected in (1, 2):
            reply = trainer.call({"cmd": "train"}, batch, timeout_s=300)
            assert reply["version"] == expected
        version, before = _relay_weights(relay_a.address)
        assert version == 2

        os.kill(role.proc.pid, signal.SIGKILL)  # no chance to flush or close anything
        role.proc.wait()
        cluster.roles.remove(role)
        trainer.close()

        # The resumed trainer publishes to a fresh relay, so what it holds is compared
        # byte for byte with what the killed one published.
        relay_b = cluster.start_relay("relay_b")
        cluster.wait_relay_ready(relay_b)
        _, trainer, init = _start_trainer(cluster, cfg_path, tiny_model_dir, relay_b)
        assert init == {"version": 2, "resumed_from": 2}
        version, after = _relay_weights(relay_b.address)
        assert version == 2 and before.keys() == after.keys()
        for name in before:
            np.testing.assert_array_equal(before[name], after[name], err_msg=name)
        assert trainer.call({"cmd": "train"}, batch, timeout_s=300)["version"] == 3
        trainer.call({"cmd": "shutdown"}, timeout_s=60)
    finally:
        cluster.stop()


def test_a_damaged_latest_checkpoint_is_skipped_and_rolled_past_with_the_logged_batches(
        tmp_path, tiny_model_dir, write_run_config):
    """Storage truncates the newest checkpoint's largest file: the resumed trainer names
    it, moves it aside, restores the one before and replays the logged batch after it,
    so it is back at the version it had with the same bytes (nothing lost, nothing
    trained twice); with checkpoint_keep 2 the batch it needs was kept."""
    run_dir = tmp_path / "run"
    cfg_path = write_run_config(run_dir, run_dir=str(run_dir),
                                trainer={"checkpoint_every": 1, "checkpoint_keep": 2})
    cluster = Cluster(run_dir)
    try:
        relay_a = cluster.start_relay("relay_a")
        cluster.wait_relay_ready(relay_a)
        role, trainer, init = _start_trainer(cluster, cfg_path, tiny_model_dir, relay_a)
        batch = toy_batch(seq_len=16)
        for expected in (1, 2, 3):
            assert trainer.call({"cmd": "train"}, batch, timeout_s=300)["version"] == expected
        _, before = _relay_weights(relay_a.address)
        trainer.call({"cmd": "shutdown"}, timeout_s=60)
        role.proc.wait()
        cluster.roles.remove(role)
        trainer.close()
        newest = run_dir / "checkpoints" / "3"
        largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        with open(largest, "r+b") as f:
            f.truncate(largest.stat().st_size // 2)

        relay_b = cluster.start_relay("relay_b")
        cluster.wait_relay_ready(relay_b)
        role, trainer, init = _start_trainer(cluster, cfg_path, tiny_model_dir, relay_b)
        assert init == {"version": 3, "resumed_from": 3}
        version, after = _relay_weights(relay_b.address)
        assert version == 3
        for name in before:
            np.testing.assert_array_equal(before[name], after[name], err_msg=name)
        bad = run_dir / "checkpoints_bad" / "3"
        assert largest.name in (bad / "reason.txt").read_text() and not newest.exists()
        assert "checkpoint 3 skipped" in role.log_path.read_text()
        assert trainer.call({"cmd": "train"}, batch, timeout_s=300)["version"] == 4
        trainer.call({"cmd": "shutdown"}, timeout_s=60)
    finally:
        cluster.stop()
