"""The relay tier's fault handling with real processes: a hung (SIGSTOPped) master is
left by the trainer's publisher within the tier's detection window, every chain repair
is recorded with its cause, a replacement relay joins the chain, and `RelayTier.stop`
leaves no process and no segment."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from fnrl.config import RelayConfig
from fnrl.relay import store
from fnrl.relay.chain import AlreadyInChain, detection_window_s
from fnrl.relay.client import MasterPublisher, RelayClient, RelayError, RelayUnresponsive
from fnrl.relay.role import segment_prefix

pytestmark = pytest.mark.slow

CFG = RelayConfig(num_relays=3, chunk_bytes=256 * 1024, chunk_timeout_s=5.0, heartbeat_s=0.2,
                  heartbeat_timeout_s=1.0)
# The trainer's bulk publish timeout: what a hung master used to cost every publish.
BULK_TIMEOUT_S = 120.0


def weights(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full((2**18,), version, np.float32)}


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def serves(address: str, version: int) -> bool:
    with RelayClient(address, timeout_s=30) as c:
        return c.wait_version(version, timeout_s=60) == version


def segments_of(tier) -> list[str]:
    return [p.name for name in tier.members
            for p in store.SHM_DIR.glob(f"{segment_prefix(name)}*")]


def test_liveness_waits_for_a_slow_relay_but_not_for_a_stopped_one(relay):
    with RelayClient(relay.address, timeout_s=BULK_TIMEOUT_S, liveness_s=1.5) as client:
        # Slow: the relay answers only after 4 s (nothing to wait for arrives), but it
        # answers pings meanwhile, so the wait is not cut short at `liveness_s`.
        start = time.monotonic()
        with pytest.raises(RelayError, match="not visible in time") as slow:
            client.wait_version(7, timeout_s=4.0)
        assert not isinstance(slow.value, RelayUnresponsive)
        assert time.monotonic() - start >= 4.0
        os.kill(relay.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RelayUnresponsive, match="answered no ping"):
                client.wait_version(7, timeout_s=60.0)
            assert time.monotonic() - start < 30.0  # not the 60 + 120 s of the call
        finally:
            os.kill(relay.proc.pid, signal.SIGCONT)


def test_a_hung_master_costs_a_publish_the_detection_window_not_the_timeout(tier_factory):
    tier = tier_factory(CFG)
    tier.start_monitor()
    old = tier.master
    publisher = MasterPublisher(tier.addresses, timeout_s=BULK_TIMEOUT_S,
                                liveness_s=detection_window_s(CFG))
    try:
        publisher.publish(1, weights(1))
        wait_for(lambda: all(serves(a, 1) for a in tier.addresses), "version 1 not everywhere")
        os.kill(old.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        publisher.publish(2, weights(2))
        took = time.monotonic() - start
        assert publisher.master.address != old.address
    finally:
        publisher.close()
    # Detection plus one publish: seconds, where it was the whole bulk timeout before.
    assert took < BULK_TIMEOUT_S / 2, took
    (event,) = tier.events()
    assert (event.relay, event.cause, event.was_master) == (old.name, "stopped", True)
    assert event.master == tier.master.name != old.name
    assert event.failed_at <= event.detected_at <= event.repaired_at
    assert 0 < event.detection_s <= took + 10.0 and event.repair_s >= 0
    wait_for(lambda: all(serves(a, 2) for a in tier.addresses), "version 2 not everywhere")
    assert len(tier.addresses) == 2


def test_events_and_stop_after_a_stopped_master_and_a_killed_relay(tier_factory):
    tier = tier_factory(CFG)
    tier.start_monitor()
    master, middle, tail = (tier.members[n] for n in tier.plan.order)
    with RelayClient(master.address, timeout_s=30) as client:
        client.publish(1, weights(1), wait="visible")
    wait_for(lambda: all(serves(a, 1) for a in tier.addresses), "version 1 not everywhere")
    os.kill(master.proc.pid, signal.SIGSTOP)
    tail.proc.kill()
    wait_for(lambda: len(tier.events()) == 2, f"repairs seen: {tier.events()}")
    causes = {e.relay: (e.cause, e.was_master) for e in tier.events()}
    assert causes == {master.name: ("stopped", True), tail.name: ("exited", False)}
    assert tier.plan.order == (middle.name,)
    # Both left segments behind: a stopped relay cannot clean up, a killed one never will.
    left = segments_of(tier)
    assert any(s.startswith(segment_prefix(master.name)) for s in left), left
    assert any(s.startswith(segment_prefix(tail.name)) for s in left), left

    tier.stop(grace_s=30.0)
    assert segments_of(tier) == []
    assert all(m.proc.poll() is not None for m in tier.members.values())
    # Continued before SIGTERM, the stopped master ran its own clean exit (not SIGKILL).
    assert master.proc.returncode == 0
    tier.stop()  # idempotent
    assert segments_of(tier) == []


def version_at(address: str) -> int | None:
    with RelayClient(address, timeout_s=30) as c:
        return c.ping()["version"]


def test_a_replacement_joins_at_the_tail_and_serves_only_once_caught_up(tier_factory, tmp_path):
    tier = tier_factory(CFG)
    tier.start_monitor()
    master, middle, tail = (tier.members[n] for n in tier.plan.order)
    homed = 1   # rollout 1 pulls from relay 1 (index % 3): the middle one
    assert tier.local_address(homed) == middle.address
    with RelayClient(master.address, timeout_s=30) as client:
        client.publish(1, weights(1), wait="visible")
        client.publish(2, weights(2), wait="visible")
    wait_for(lambda: all(serves(a, 2) for a in tier.addresses), "version 2 not everywhere")
    middle.proc.kill()
    wait_for(lambda: middle.name in tier.removed, "the killed relay was never spliced out")
    assert tier.local_address(homed) in (master.address, tail.address)

    newcomer = tier.start_replacement(middle.name, tmp_path)
    assert newcomer.address != middle.address and version_at(newcomer.address) is None
    joined: list = []
    joining = threading.Thread(target=lambda: joined.append(tier.join(newcomer)))
    joining.start()
    # Whenever rollout 1 is sent to the newcomer, the newcomer already holds version 2.
    seen = []
    while joining.is_alive() or not seen or seen[-1][0] != newcomer.address:
        address = tier.local_address(homed)
        seen.append((address, version_at(newcomer.address)))
        assert address != newcomer.address or seen[-1][1] == 2, seen
        time.sleep(0.01)
    joining.join()
    assert joined == [2]
    assert tier.plan.order == (master.name, tail.name, middle.name)   # at the tail
    assert tier.plan.epoch == 2 and tier.members[middle.name].proc is newcomer.proc
    with pytest.raises(AlreadyInChain):
        tier.join(newcomer)

    # A version published after the join reaches every relay, the old tail and the
    # newcomer behind it included.
    with RelayClient(master.address, timeout_s=30) as client:
        client.publish(3, weights(3), wait="visible")
    wait_for(lambda: all(serves(a, 3) for a in (master.address, tail.address, newcomer.address)),
             "version 3 not everywhere")
    assert tier.addresses == [master.address, tail.address, newcomer.address]
    (event,) = tier.events()   # the join is no repair
    assert (event.relay, event.cause) == (middle.name, "exited")
    tier.stop()
    assert segments_of(tier) == [] and newcomer.proc.poll() is not None
