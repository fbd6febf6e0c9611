"""The worker extension's failure paths without vLLM: `pull` over fake relays and a fake
reload, and `RelayWeightLoader.fnrl_pull` on a fake worker against a real relay."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fnrl.relay import store
from fnrl.relay.client import RelayClient, RelayError
from fnrl.serving import worker_ext
from fnrl.serving.worker_ext import RelayWeightLoader, pull


def weights(version: int) -> dict[str, np.ndarray]:
    return {"a": np.full((3, 5), version, np.float32), "b": np.arange(7, dtype=np.int64)}


@pytest.fixture
def write_version():
    """Call it to write a version into a fresh segment; returns its manifest."""
    made = []

    def write(version: int) -> store.VersionManifest:
        arrays = weights(version)
        manifest = store.plan_layout(
            version=version, segment=f"fnrl-test-{uuid.uuid4().hex[:12]}",
            tensors=[(n, a.shape, str(a.dtype)) for n, a in arrays.items()])
        made.append(manifest.segment)
        mm = store.create_segment(manifest.segment, manifest.total_bytes)
        for name, view in store.tensor_views(mm, manifest).items():
            view[...] = arrays[name]
        return manifest

    yield write
    for segment in made:
        store.unlink_segment(segment)


def retired(version: int) -> store.VersionManifest:
    """A manifest whose segment the relay already unlinked."""
    return store.plan_layout(version=version, segment=f"fnrl-test-gone-{uuid.uuid4().hex}",
                             tensors=[("a", (3,), "float32")])


class FakeRelay:
    """Answers `latest` with the given manifests in turn (the last one repeats) and
    `wait_version` with `wait_error` if set; records every call."""

    address = "tcp://fake-relay"

    def __init__(self, manifests: list, wait_error: Exception | None = None):
        self.manifests, self.wait_error, self.calls = list(manifests), wait_error, []

    def wait_version(self, version: int, *, timeout_s: float) -> int:
        self.calls.append(("wait_version", version))
        if self.wait_error is not None:
            raise self.wait_error
        return version

    def latest(self) -> store.VersionManifest | None:
        self.calls.append(("latest",))
        return self.manifests.pop(0) if len(self.manifests) > 1 else self.manifests[0]


def test_a_version_retired_before_it_is_opened_is_asked_for_again(write_version):
    relay = FakeRelay([retired(2), retired(3), write_version(4)])
    loaded = []
    manifest = pull(relay, served=1, reload=lambda arrays: loaded.append(dict(arrays)),
                    timeout_s=1.0)
    assert manifest.version == 4 and relay.calls == [("latest",)] * 3
    (arrays,) = loaded
    for name, expected in weights(4).items():
        np.testing.assert_array_equal(arrays[name], expected)


def test_versions_replaced_faster_than_read_give_up_after_the_attempts():
    relay = FakeRelay([retired(v) for v in range(2, 20)])
    loaded = []
    with pytest.raises(RuntimeError, match=f"in {worker_ext._OPEN_ATTEMPTS} attempts"):
        pull(relay, served=1, reload=loaded.append, timeout_s=1.0)
    assert relay.calls == [("latest",)] * worker_ext._OPEN_ATTEMPTS and loaded == []


def test_min_version_not_reached_loads_nothing(write_version):
    # The relay holds version 3 but the coordinator asked for 5: loading 3 would serve
    # an older version than planned.
    relay = FakeRelay([write_version(3)], wait_error=RelayError("version 5 not visible in time"))
    loaded = []
    with pytest.raises(RelayError, match="not visible"):
        pull(relay, served=1, reload=loaded.append, timeout_s=1.0, min_version=5)
    assert relay.calls == [("wait_version", 5)] and loaded == []
    # Already serving the asked-for version: no wait, and nothing newer to load.
    relay = FakeRelay([write_version(5)], wait_error=RelayError("must not be asked"))
    assert pull(relay, served=5, reload=loaded.append, timeout_s=1.0, min_version=5) is None
    assert relay.calls == [("latest",)] and loaded == []


class FakeWorker(RelayWeightLoader):
    """A vLLM worker's `reload_weights`, failing while `fail` is set."""

    def __init__(self, fail: bool):
        self.fail, self.loaded = fail, []

    def reload_weights(self, weights_iterator) -> None:
        tensors = {name: t.clone().numpy() for name, t in weights_iterator}
        if self.fail:
            raise RuntimeError("reload failed")
        self.loaded.append(tensors)


@pytest.mark.slow
def test_a_failed_load_keeps_the_old_version_and_the_next_pull_retries(relay_address):
    with RelayClient(relay_address, timeout_s=30) as client:
        client.publish(1, weights(1))
    worker = FakeWorker(fail=True)
    with pytest.raises(RuntimeError, match="reload failed"):
        worker.fnrl_pull(relay_address)
    assert worker.fnrl_version() == -1 and worker.loaded == []
    worker.fail = False
    assert worker.fnrl_pull(relay_address, "30") == 1 == worker.fnrl_version()
    (tensors,) = worker.loaded
    np.testing.assert_array_equal(tensors["a"], weights(1)["a"])
    assert worker.fnrl_reload_seconds() > 0


@pytest.mark.slow
def test_min_version_times_out_against_a_real_relay(relay_address):
    with RelayClient(relay_address, timeout_s=30) as client:
        latest = client.latest()
        client.publish(latest.version + 1 if latest else 1, weights(1))
        held = client.latest().version
    worker = FakeWorker(fail=False)
    with pytest.raises(RelayError, match=f"version {held + 5} not visible in time"):
        worker.fnrl_pull(relay_address, timeout_s=1.0, min_version=held + 5)
    assert worker.fnrl_version() == -1 and worker.loaded == []
