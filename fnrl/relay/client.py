"""Clients of the relay role (`fnrl.relay.role`): publish a version, ask for the latest.

`RelayClient` talks to one relay; `MasterPublisher` is the trainer's: it publishes to the
chain's master and follows the tier controller when a dead master is replaced.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import zmq

from fnrl.relay import store
from fnrl.relay.store import VersionManifest
from fnrl.shell import auth

log = logging.getLogger("fnrl.relay")


class RelayError(RuntimeError):
    """The relay answered with an error, or did not answer in time."""


class RelayTimeout(RelayError):
    """The relay did not answer within the timeout (dead, hung or unreachable)."""


class RelayUnresponsive(RelayTimeout):
    """The relay stopped answering pings (or was replaced) while a reply was awaited."""


class RelayClient:
    """Blocking request/reply client of one relay; every call has a timeout.

    After a timeout the socket is thrown away and the next call opens a fresh one
    (ZeroMQ's "lazy pirate" pattern), so a late reply can never be mistaken for the
    answer to a later request.

    `liveness_s` tells "slow" from "no progress": while a reply (or an inbox slot) is
    awaited, the relay is pinged on a second socket; once it has answered none for
    `liveness_s`, or `superseded()` says it was replaced meanwhile, `RelayUnresponsive`
    is raised without waiting out `timeout_s`. A relay that answers is waited for.
    """

    def __init__(self, address: str, *, timeout_s: float = 10.0, liveness_s: float | None = None,
                 superseded: Callable[[], bool] | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.liveness_s, self.superseded = liveness_s, superseded
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lent: dict[str, _LentSlot] = {}  # inbox slots the relay lent us, mapped once
        self._one_slot = False  # the relay lends only one slot: the last version's
        self.last_published: tuple[int, dict[str, np.ndarray]] | None = None
        """The last version handed off and views of it in its inbox slot."""
        self._published_segment: str | None = None  # the slot last_published lies in
        self._nonce: str | None = None  # of the request in flight: its reply must name it

    def publish(
        self,
        version: int,
        tensors: Mapping[str, np.ndarray],
        *,
        wait: str = "visible",
        timeout_s: float | None = None,
    ) -> None:
        """Hand one complete version to a relay on this host through shared memory.

        The relay lends inbox slots (each mapped here once, then reused); this process
        copies the tensors into one and a `commit` message hands it over: the caller's
        stall is one memory copy plus one message (two when a slot is first lent). A slot
        stays locked by the relay while it copies it out, and the copy into it waits for
        that. Slots alternate when the relay lends two, so the last version stays intact
        for a new master should this one die. `wait="held"` returns as soon as the relay
        holds the version; `"visible"` once the relay serves it as latest.
        """
        if wait not in ("held", "visible"):
            raise ValueError(f"wait={wait!r}: use 'held' or 'visible'")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        arrays = {name: np.asarray(a) for name, a in tensors.items()}
        specs = [(n, a.shape, store.dtype_name(a.dtype)) for n, a in arrays.items()]
        layout, slot = self._slot_for(int(version), specs, timeout_s)
        views = store.tensor_views(slot.mm, layout)
        self._await(slot.try_lock, timeout_s, "free its inbox slot")
        if layout.segment == self._published_segment:  # about to be overwritten
            self.last_published = self._published_segment = None
        try:
            # The commit goes out first, so its round trip overlaps the copy: the relay
            # answers at once and takes the slot's lock once we let go of it.
            self._send({"op": "commit", "version": int(version), "segment": layout.segment,
                        "tensors": _tensor_specs(arrays), "wait": wait}, [], timeout_s)
            try:
                for name, a in arrays.items():
                    if a.size:  # the view of an empty tensor is a read-only placeholder
                        np.copyto(views[name], a, casting="no")
            except BaseException:
                self.close()  # its reply is not awaited; the relay drops the unwritten version
                raise
            slot.marks[store.SLOT_WRITTEN] = version
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
        try:
            self._reply("commit", timeout_s)
        except RelayError as err:
            if not isinstance(err, RelayTimeout):  # e.g. the relay replaced the slot
                self._forget_slot(layout.segment)
            raise
        slot.pending = int(version)
        self.last_published, self._published_segment = (int(version), views), layout.segment

    def _slot_for(self, version: int, specs: list, timeout_s: float
                  ) -> tuple[VersionManifest, _LentSlot]:
        """A lent slot the version fits in, laid out as the relay lays it out
        (`store.plan_layout`); asks the relay for one (a round trip) only if none fits."""
        avoid = None if self._one_slot else self._published_segment
        for segment, slot in self._lent.items():
            if segment != avoid:
                layout = store.plan_layout(version=version, segment=segment, tensors=specs)
                if layout.total_bytes <= slot.capacity:
                    return layout, slot
        reply = self._request({"op": "reserve", "version": version, "avoid": avoid,
                               "tensors": [{"name": n, "shape": list(shape), "dtype": dtype}
                                           for n, shape, dtype in specs]}, [], timeout_s)
        layout = VersionManifest.from_json(json.dumps(reply["manifest"]))
        self._one_slot = reply.get("inbox_slots", 1) == 1
        for segment in [s for s in self._lent if s not in (layout.segment, avoid)]:
            self._forget_slot(segment)  # replaced by the relay
        slot = self._lent.get(layout.segment)
        if slot is None or slot.capacity < layout.total_bytes:
            slot = self._lent[layout.segment] = _LentSlot.open(layout.segment)
        return layout, slot

    def _forget_slot(self, segment: str) -> None:
        slot = self._lent.pop(segment, None)
        if slot is not None:
            os.close(slot.fd)  # the mapping goes with the last view of it

    def publish_frames(
        self,
        version: int,
        tensors: Mapping[str, np.ndarray],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Send one complete version as ZeroMQ frames (a publisher on another host);
        returns once the relay serves it as latest."""
        arrays = {name: _c_contiguous(a) for name, a in tensors.items()}
        header = {"op": "publish", "version": int(version), "tensors": _tensor_specs(arrays)}
        # Raw bytes views: zero-copy, and dtype-agnostic (bfloat16 has no buffer format).
        frames = [a.reshape(-1).view(np.uint8) for a in arrays.values()]
        self._request(header, frames, timeout_s, bulk=True)

    def latest(self, *, timeout_s: float | None = None,
               version: int | None = None) -> VersionManifest | None:
        """The manifest of the newest complete version, or None if nothing is published;
        with `version`, that version's manifest, or None if the relay no longer holds it."""
        header = {"op": "latest"} if version is None else {"op": "latest", "version": int(version)}
        manifest = self._request(header, [], timeout_s)["manifest"]
        return None if manifest is None else VersionManifest.from_dict(manifest)

    def ping(self, *, timeout_s: float | None = None) -> dict:
        """`{"name", "pid", "version", "ucx_address", "master", "master_address", "epoch",
        "downstream"}` of the relay."""
        reply = self._request({"op": "ping"}, [], timeout_s)
        reply.pop("ok")
        return reply

    def wait_version(self, version: int, *, timeout_s: float = 10.0) -> int:
        """Block until the relay serves `version` or newer; returns the version it serves."""
        return self._request({"op": "wait_version", "version": int(version),
                              "timeout_s": timeout_s}, [], timeout_s + self.timeout_s)["version"]

    def set_chain(self, *, epoch: int, master: str, master_address: str,
                  downstream: dict | None, timeout_s: float | None = None) -> None:
        """Tell the relay its chain: who is master, and its downstream `{"name",
        "ucx_address"}` (None at the tail). Used by `fnrl.relay.tier.RelayTier`."""
        self._request({"op": "set_chain", "epoch": epoch, "master": master,
                       "master_address": master_address, "downstream": downstream}, [],
                      timeout_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _request(self, header: dict, frames: list, timeout_s: float | None, *,
                 bulk: bool = False) -> dict:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._send(header, frames, timeout_s, bulk=bulk)
        return self._reply(header["op"], timeout_s)

    def _send(self, header: dict, frames: list, timeout_s: float, *, bulk: bool = False) -> None:
        sock = self._socket()
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        # Sealed with the run's secret; weight bytes (`bulk`) are covered by length only.
        sealed, self._nonce = auth.process_auth().seal(header, frames, bulk=bulk)
        try:
            # copy=False hands the arrays' memory to ZeroMQ without copying; the reply
            # comes only after the relay has read every frame, so the arrays are free
            # to change once it is in.
            sock.send_multipart(sealed, copy=False)
        except zmq.Again:
            self.close()
            raise RelayTimeout(f"relay {self.address} did not take {header['op']!r} "
                               f"within {timeout_s:g} s") from None

    def _reply(self, op: str, timeout_s: float) -> dict:
        sock = self._socket()
        try:
            self._await(lambda wait_s: bool(sock.poll(int(wait_s * 1000), zmq.POLLIN)),
                        timeout_s, f"answer {op!r}")
            frames = sock.recv_multipart()
        except RelayTimeout:
            self.close()
            raise
        try:
            reply, _ = auth.process_auth().open(frames, reply_to=self._nonce)
        except auth.Refused as err:
            reason = auth.refusal_reason(frames)
            if reason is not None:
                raise RelayError(f"relay {self.address} refused {op!r}: {reason}") from None
            raise RelayError(f"relay {self.address}: reply to {op!r} refused: {err}") from None
        if not reply.get("ok"):
            raise RelayError(f"relay {self.address} refused {op!r}: {reply.get('error')}")
        return reply

    def _await(self, ready: Callable[[float], bool], timeout_s: float, what: str) -> None:
        """Return once `ready(wait_s)` (which waits up to `wait_s`) is true; raise
        RelayTimeout after `timeout_s`, or RelayUnresponsive as `liveness_s` says."""
        start = time.monotonic()
        deadline, heard = start + timeout_s, start
        step_s = timeout_s if self.liveness_s is None else min(0.25, self.liveness_s / 4)
        probe = None
        try:
            while not ready(max(0.0, min(step_s, deadline - time.monotonic()))):
                now = time.monotonic()
                if now >= deadline:
                    raise RelayTimeout(f"relay {self.address} did not {what} within {timeout_s:g} s")
                if self.liveness_s is None:
                    continue
                # One ping in flight at a time, on a socket of its own (the main one
                # carries the awaited request); an answer however late counts as life.
                if probe is None:
                    probe = self._ctx.socket(zmq.REQ)
                    probe.setsockopt(zmq.LINGER, 0)
                    probe.connect(self.address)
                    sealed, pinged = auth.process_auth().seal({"op": "ping"})
                    probe.send_multipart(sealed)
                elif probe.poll(0, zmq.POLLIN):
                    try:
                        auth.process_auth().open(probe.recv_multipart(), reply_to=pinged)
                        heard = now
                    except auth.Refused:
                        pass   # not an answer of this relay's: no sign of life
                    sealed, pinged = auth.process_auth().seal({"op": "ping"})
                    probe.send_multipart(sealed)
                if now - heard < 2 * step_s:
                    continue
                # Silent: leave as soon as the tier has replaced it, or after liveness_s.
                if self.superseded is not None and self.superseded():
                    raise RelayUnresponsive(f"relay {self.address} stopped answering and was "
                                            f"replaced while we waited for it to {what}")
                if now - heard >= self.liveness_s:
                    raise RelayUnresponsive(f"relay {self.address} answered no ping for "
                                            f"{self.liveness_s:g} s while we waited for it to {what}")
        finally:
            if probe is not None:
                probe.close(linger=0)

    def answers_ping(self, timeout_s: float) -> bool:
        """Whether the relay answers a ping within `timeout_s`."""
        # A socket of its own: a request in flight on the main one stays undisturbed.
        with RelayClient(self.address, timeout_s=timeout_s) as probe:
            try:
                probe.ping()
                return True
            except RelayError:
                return False


def _tensor_specs(arrays: Mapping[str, np.ndarray]) -> list[dict]:
    return [{"name": n, "shape": list(a.shape), "dtype": store.dtype_name(a.dtype)}
            for n, a in arrays.items()]


@dataclasses.dataclass(eq=False)
class _LentSlot:
    """An inbox slot of the relay, mapped writable here; `fd` carries the slot's lock,
    `marks` the versions last written here and taken by the relay (`store.slot_marks`)."""

    mm: mmap.mmap
    fd: int
    marks: np.ndarray
    pending: int | None = None  # the version last handed off in it

    @classmethod
    def open(cls, segment: str) -> _LentSlot:
        fd = os.open(store.SHM_DIR / segment, os.O_RDWR)
        mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        return cls(mm=mm, fd=fd, marks=store.slot_marks(mm))

    @property
    def capacity(self) -> int:
        return len(self.mm) - store.SLOT_TAIL

    def try_lock(self, wait_s: float) -> bool:
        """Take the slot's lock once the relay has taken the version handed off in it
        before and copied it out (about one memory copy; a relay that dies drops it);
        False if that has not happened within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.pending is None or self.marks[store.SLOT_TAKEN] >= self.pending:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(50e-6)


def _c_contiguous(a: np.ndarray) -> np.ndarray:
    """`a` itself when already C-contiguous (the usual case: no copy), else a copy.

    Not np.ascontiguousarray, which turns 0-d arrays into 1-d ones.
    """
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")


class MasterPublisher:
    """The trainer's publisher: hands versions to the chain's master relay.

    When the master does not answer, it asks the other relays which master the tier
    controller has elected since, re-hands the last version over if the new master lacks
    it (a version the old master held but had not finished broadcasting), and retries.

    `timeout_s` bounds a call to a master that answers pings (a big, slow transfer);
    `liveness_s` bounds the wait on one that has stopped answering them (SIGSTOPped,
    hung), and a master the tier has replaced meanwhile is left at once. With the tier's
    detection window (`fnrl.relay.chain.detection_window_s`) a hung master costs a
    publish about that window plus one publish.
    """

    def __init__(self, addresses: Sequence[str], *, timeout_s: float = 60.0,
                 failover_timeout_s: float = 30.0, liveness_s: float | None = None):
        if not addresses:
            raise ValueError("addresses=[]: need at least one relay")
        self.addresses = list(addresses)
        self.timeout_s, self.failover_timeout_s = timeout_s, failover_timeout_s
        self.liveness_s = liveness_s
        self.master = self._client(self.addresses[0])

    def latest(self) -> VersionManifest | None:
        return self._with_failover(lambda c, retry: c.latest())

    def publish(self, version: int, tensors: Mapping[str, np.ndarray], *,
                wait: str = "held") -> None:
        def attempt(client: RelayClient, retry: bool) -> None:
            # A master that recovered may hold the version its silence cut short.
            latest = client.latest() if retry else None
            if latest is None or latest.version < version:
                client.publish(version, tensors, wait=wait)

        self._with_failover(attempt)

    def close(self) -> None:
        self.master.close()

    def _client(self, address: str) -> RelayClient:
        return RelayClient(address, timeout_s=self.timeout_s, liveness_s=self.liveness_s,
                           superseded=lambda: self._elected_elsewhere(address))

    def _elected_elsewhere(self, address: str) -> bool:
        """Whether another relay names a master other than `address` (the tier replaced it)."""
        for peer in self.addresses:
            if peer != address and self._elected_by(peer) not in (None, address):
                return True
        return False

    def _elected_by(self, peer: str) -> str | None:
        """The master `peer` was told of by the tier; None if it does not answer or has
        not been given a place yet."""
        probe_s = 1.0 if self.liveness_s is None else min(1.0, self.liveness_s / 3)
        try:
            with RelayClient(peer, timeout_s=probe_s) as relay:
                ping = relay.ping()
        except RelayError:
            return None
        return ping["master_address"] if ping["epoch"] >= 0 else None

    def _with_failover(self, call):
        try:
            return call(self.master, False)
        except RelayTimeout as err:
            log.warning("master relay %s did not answer (%s); looking for the new master",
                        self.master.address, err)
        self._follow_new_master()
        return call(self.master, True)

    def _follow_new_master(self) -> None:
        """Switch to the master the tier elected; or stay, if ours answers again and no
        other has been elected (a master that was slow, not dead)."""
        dead = self.master.address
        deadline = time.monotonic() + self.failover_timeout_s
        while time.monotonic() < deadline:
            for address in self.addresses:
                elected = None if address == dead else self._elected_by(address)
                if elected not in (None, dead):
                    self._switch(elected)
                    return
            if self.master.answers_ping(1.0):
                log.warning("master relay %s answers again; retrying", dead)
                return
            time.sleep(0.2)
        raise RelayTimeout(f"no new master relay elected within {self.failover_timeout_s:g} s "
                           f"after {dead} stopped answering")

    def _switch(self, address: str) -> None:
        last = self.master.last_published
        self.master.close()
        self.master = self._client(address)
        log.warning("publishing to the new master relay %s", address)
        latest = self.master.latest()
        if last is not None and (latest is None or latest.version < last[0]):
            # The old inbox slot stays mapped here after its relay died: hand it over again.
            self.master.publish(last[0], last[1], wait="held")
