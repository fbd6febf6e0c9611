"""Real relay processes: publish, latest, zero-copy reads, retention, errors, kills."""

from __future__ import annotations

import signal
import time

import ml_dtypes
import numpy as np
import pytest

from fnrl.relay import store
from fnrl.relay.client import RelayClient, RelayError, RelayTimeout

pytestmark = pytest.mark.slow


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((5, 7)).astype(np.float32)
    f32[0, :4] = [np.nan, np.inf, -np.inf, -0.0]  # bit-exact means these survive too
    return {
        "model.embed_tokens.weight": f32,
        "model.norm.weight": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
        "lm_head.weight": rng.standard_normal((3, 4)).astype(np.float16).T,  # strided
        "counts": rng.integers(-(2**31), 2**31 - 1, size=(2, 3, 4), dtype=np.int32),
        "scalar": np.array(seed, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def assert_bit_exact(views: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(views) == list(expected)
    for name, a in expected.items():
        v = views[name]
        assert (v.dtype, v.shape) == (a.dtype, a.shape), name
        assert np.ascontiguousarray(a).tobytes() == v.tobytes(), name


def test_publish_latest_open_round_trip(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        assert client.latest() is None
        assert client.ping()["version"] is None
        client.publish(3, weights(3))
        manifest = client.latest()
        assert manifest.version == 3 and client.ping()["version"] == 3
        assert all(t.offset % store.ALIGNMENT == 0 for t in manifest.tensors)
        assert_bit_exact(store.open_version(manifest), weights(3))


def test_keeps_two_newest_segments(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        for version in range(10):
            client.publish(version, weights(version))
            assert len(relay.segments()) == min(version + 1, 2)
        assert [s.rsplit("-v", 1)[1] for s in relay.segments()] == ["8", "9"]
        assert_bit_exact(store.open_version(client.latest()), weights(9))


def wait_spare(client: RelayClient) -> None:
    deadline = time.monotonic() + 10
    while not client.ping()["spare_ready"]:
        assert time.monotonic() < deadline, "no spare segment prepared"
        time.sleep(0.01)


def test_reader_keeps_its_version_while_newer_ones_replace_it(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        client.publish(1, weights(1))
        held = store.open_version(client.latest())
        stale = client.latest()
        client.publish(2, weights(2))
        client.publish(3, weights(3))  # retires version 1's segment
        assert stale.segment not in relay.segments()
        for version in (4, 5, 6):  # a segment a reader maps is never reused
            wait_spare(client)
            client.publish(version, weights(version))
        assert_bit_exact(held, weights(1))
        # A reader that comes too late gets FileNotFoundError and asks again.
        with pytest.raises(FileNotFoundError):
            store.open_version(stale)
        assert_bit_exact(store.open_version(client.latest()), weights(6))


def test_retired_segment_nobody_reads_is_reused_for_a_later_version(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        inodes = {}
        for version in range(1, 6):
            wait_spare(client)
            client.publish(version, weights(version))
            manifest = client.latest()
            inodes[version] = (store.SHM_DIR / manifest.segment).stat().st_ino
            assert_bit_exact(store.open_version(manifest), weights(version))  # then let go
        # Two versions kept, so version v is written where version v - 3 was.
        assert inodes[4] == inodes[1] and inodes[5] == inodes[2]
        assert len(set(inodes.values())) == 3


def test_old_or_equal_version_rejected(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        client.publish(5, weights(5))
        for version in (5, 4):
            with pytest.raises(RelayError, match=rf"version {version} .* latest 5"):
                client.publish(version, weights(version))
        assert client.latest().version == 5
        assert relay.address in str(pytest.raises(RelayError, client.publish, 1, {}).value)


def test_malformed_publish_rejected_and_relay_survives(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        header = {
            "op": "publish",
            "version": 1,
            "tensors": [{"name": "a", "shape": [4], "dtype": "float32"}],
        }
        with pytest.raises(RelayError, match="has 3 bytes, expected 16"):
            client._request(header, [b"abc"], None)
        with pytest.raises(RelayError, match="unknown op"):
            client._request({"op": "nope"}, [], None)
        assert relay.segments() == []
        client.publish(1, {"a": np.ones(4, np.float32)})
        assert client.latest().version == 1


def test_killed_relay_raises_within_timeout(relay):
    with RelayClient(relay.address, timeout_s=1.0) as client:
        client.publish(1, weights(1))
        relay.proc.send_signal(signal.SIGKILL)
        relay.proc.wait(5)
        for call in (client.ping, client.latest, lambda: client.publish(2, weights(2))):
            start = time.monotonic()
            with pytest.raises(RelayTimeout, match=relay.address):
                call()
            assert time.monotonic() - start < 3.0


def test_sigterm_unlinks_segments(relay):
    with RelayClient(relay.address, timeout_s=5) as client:
        client.publish(1, weights(1))
        client.publish(2, weights(2))
    assert len(relay.segments()) == 2
    relay.proc.send_signal(signal.SIGTERM)
    assert relay.proc.wait(10) == 0
    assert relay.segments() == []


def test_restarted_relay_removes_segments_of_its_killed_predecessor(relay_factory):
    first = relay_factory()
    with RelayClient(first.address, timeout_s=5) as client:
        client.publish(1, weights(1))
    first.proc.kill()
    first.proc.wait(5)
    assert len(first.segments()) == 1  # SIGKILL leaves the segment behind
    second = relay_factory(first.name)
    assert first.segments() == [] and second.segments() == []


def test_relay_whose_address_is_taken_exits_with_its_error(tmp_path):
    import socket
    import uuid

    from fnrl.relay.launch import launch_relay

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        name = f"t{uuid.uuid4().hex[:10]}"
        proc = launch_relay(f"tcp://127.0.0.1:{taken.getsockname()[1]}", name,
                            tmp_path / "relay.log")
        try:
            assert proc.wait(30) == 1  # not left running with UCX's thread alive
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "Address already in use" in (tmp_path / "relay.log").read_text()


class _Interrupted(Exception):
    pass


def test_a_publisher_stopped_mid_copy_hands_nothing_over(relay, monkeypatch):
    # The commit goes out before the copy: a publisher that fails while copying must leave
    # the relay with its last version, not a torn one, and can publish again afterwards.
    with RelayClient(relay.address, timeout_s=5) as client:
        client.publish(1, weights(1), wait="held")
        real_copyto = np.copyto

        def copy_half(dst, src, **kw):
            copy_half.calls += 1
            if copy_half.calls > 2:
                raise _Interrupted
            real_copyto(dst, src, **kw)

        copy_half.calls = 0
        monkeypatch.setattr(np, "copyto", copy_half)
        with pytest.raises(_Interrupted):
            client.publish(2, weights(2), wait="held")
        monkeypatch.undo()
        # The relay takes the slot, finds it unwritten and drops version 2: wait for that
        # (however slow the relay), so the checks below see its outcome.
        relay.wait_for_log("version 2 abandoned: its publisher stopped before it had written it")
        assert client.latest().version == 1
        assert_bit_exact(store.open_version(client.latest()), weights(1))
        client.publish(3, weights(3), wait="visible")
        assert_bit_exact(store.open_version(client.latest()), weights(3))


def test_relay_stops_when_the_process_that_launched_it_is_killed(tmp_path):
    """A process that launched a relay and dies without stopping it (SIGKILL) leaves
    neither the relay nor its segments behind (`RelayArgs.parent_pid`)."""
    import os
    import subprocess
    import sys
    import uuid

    from fnrl.relay.launch import remove_segments
    from fnrl.relay.role import segment_prefix
    from fnrl.shell import auth, procs
    from fnrl.shell.net import free_port

    name, address = f"t{uuid.uuid4().hex[:10]}", f"tcp://127.0.0.1:{free_port()}"
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from fnrl.relay.launch import launch_relay, wait_relay_ready\n"
         "p = launch_relay(sys.argv[1], sys.argv[2], sys.argv[3])\n"
         "wait_relay_ready(sys.argv[1], p)\n"
         "print(p.pid, flush=True)\n"
         "time.sleep(600)\n",
         address, name, str(tmp_path / "relay.log")],
        stdout=subprocess.PIPE, text=True, env=auth.with_secret(None))   # this run's secret
    pid = None
    try:
        pid = int(launcher.stdout.readline())
        with RelayClient(address, timeout_s=5) as client:
            client.publish(1, weights(1))
        mine = f"{segment_prefix(name)}{pid}-"
        assert any(p.name.startswith(mine) for p in store.SHM_DIR.iterdir())
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while not procs.exited(pid):   # reparented: not ours to wait on
            assert time.monotonic() < deadline, "relay outlived its killed launcher"
            time.sleep(0.05)
        assert not any(p.name.startswith(mine) for p in store.SHM_DIR.iterdir())
        assert f"parent {launcher.pid} is gone" in (tmp_path / "relay.log").read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        if pid is not None and not procs.exited(pid):
            os.kill(pid, signal.SIGKILL)
        if pid is not None:
            remove_segments(name, pid)
