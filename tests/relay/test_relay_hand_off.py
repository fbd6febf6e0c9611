"""The relay's hand-off in one process, with the interleavings that real relays meet only
on a busy machine forced: the relay's copy-and-checksum thread is held at a gate while its
event loop serves the next request."""

from __future__ import annotations

import asyncio
import threading
import uuid

import numpy as np
import pytest

from fnrl.config import RelayConfig
from fnrl.relay import role, store

TENSORS = [{"name": "w", "shape": [1000], "dtype": "float32"}]


def values(version: int) -> np.ndarray:
    return np.full(1000, version, np.float32)


class _TailOfChain:
    """The data plane of a relay without a downstream: every version counts as forwarded."""

    address = None

    def __init__(self, relay):
        pass

    def forwarded(self, version: int) -> bool:
        return True


@pytest.fixture
def relay(monkeypatch):
    monkeypatch.setattr(role, "DataPlane", _TailOfChain)  # no UCX in the test process
    relay = role.Relay(f"t{uuid.uuid4().hex[:10]}", "inproc://unused", RelayConfig())
    yield relay
    relay.close()
    # Spare segments a background task was still preparing when the loop stopped.
    for path in store.SHM_DIR.glob(f"{role.segment_prefix(relay.name)}{relay.pid}-*"):
        store.unlink_segment(path.name)


class CopyGate:
    """Holds the relay's first copy-and-checksum call in its thread until `release`."""

    def __init__(self, monkeypatch):
        self.entered, self.released = threading.Event(), threading.Event()
        real = role._copy_and_sum

        def gated(src, dst):
            if not self.entered.is_set():
                self.entered.set()
                assert self.released.wait(10), "the gate was never released"
            return real(src, dst)

        monkeypatch.setattr(role, "_copy_and_sum", gated)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), "nothing reached the gate"


async def lend(relay: role.Relay, version: int, *, written: bool = True) -> role.Slot:
    """A slot lent for `version` and written as `RelayClient.publish` writes it; not
    marked written if its publisher stopped mid-copy."""
    reply = await relay.reserve({"version": version, "tensors": TENSORS, "avoid": None})
    slot = next(s for s in relay.slots if s.segment == reply["manifest"]["segment"])
    slot.buf[: values(version).nbytes] = values(version).view(np.uint8)
    if written:
        slot.marks[store.SLOT_WRITTEN] = version
    return slot


def commit(version: int, slot: role.Slot) -> dict:
    return {"op": "commit", "version": version, "segment": slot.segment, "tensors": TENSORS,
            "wait": "held"}


def test_a_hand_off_stopped_mid_copy_leaves_the_one_before_it(relay, monkeypatch):
    # Version 2's commit arrives while version 1 (answered "held") is still copied in:
    # superseded by a version that turns out unwritten, it left the relay with nothing,
    # or, once its copy returned, served with its segment already unlinked.
    gate = CopyGate(monkeypatch)

    async def scenario():
        first = await lend(relay, 1)
        try:
            assert (await relay.handle(commit(1, first), []))["ok"]
            await gate.wait_entered()
            second = asyncio.create_task(relay.handle(commit(2, await lend(relay, 2,
                                                                           written=False)), []))
            await asyncio.sleep(0)  # the commit runs as far as it can
        finally:
            gate.released.set()
        assert (await second)["ok"]
        # Both copies over: version 1's out of its slot, version 2's abandoned.
        assert await relay.wait_until(lambda: not first.busy and relay.filling is None, 10)

    asyncio.run(scenario())
    assert relay.latest is not None and relay.latest.version == 1
    assert np.array_equal(store.open_version(relay.latest)["w"], values(1))


def test_a_version_abandoned_while_its_last_chunk_is_checked_stays_abandoned(relay, monkeypatch):
    # A version begun again while its first attempt is filling (as the data plane does
    # when its upstream sends it again): the first attempt's last chunk, already in the
    # thread, must not make it visible under the name the new attempt now fills.
    gate = CopyGate(monkeypatch)

    async def scenario():
        slot = await lend(relay, 1)
        try:
            assert (await relay.handle(commit(1, slot), []))["ok"]
            await gate.wait_entered()
            first = relay.filling
            again = relay.begin(first.manifest)
        finally:
            gate.released.set()
        assert await relay.wait_until(lambda: not slot.busy, 10)
        return first, again

    first, again = asyncio.run(scenario())
    assert first.state == "aborted" and relay.filling is again
    assert relay.latest is None


def test_abandoning_an_attempt_again_leaves_the_retried_one_alone(relay):
    # The first attempt's own check (a slot never written, or written too late) can come
    # after a retry of the same version superseded it; both attempts bear one name.
    layout = store.plan_layout(version=1, segment="", tensors=[("w", (1000,), "float32")])
    first = relay.begin(layout)
    again = relay.begin(layout)
    relay.abort(first, "its publisher stopped before it had written it")
    assert first.state == "aborted" and relay.filling is again
    assert (store.SHM_DIR / again.manifest.segment).exists()
