"""The relay's UCX data plane: versions stream down the chain, chunk by chunk.

Each relay forwards versions to its downstream neighbour in chunks, chunk i as soon as
it holds and has verified it, while chunk i+1 still arrives: the receiver posts every
chunk's receive before it asks for the data, and the sender keeps `SENDS_IN_FLIGHT`
chunks on the wire, so a hop never idles waiting for a completion to travel back.

A transfer is one session with a random 40-bit id; every message is tagged
`session << 24 | kind` (the preamble, on tag 1, is the only fixed tag), so messages of
an abandoned session can never land in a later one:

    upstream -> downstream   tag 1            [session, header length]  (uint64 x 2)
                             HEADER           sealed JSON {"layout", "reply_to", "sender",
                                              "to"} (fnrl.shell.auth: the run's secret)
                             SUM + 2i         xxh3-64 of chunk i        (uint64)
                             DATA + 2i        chunk i, received straight into the segment
    downstream -> upstream   NEED             NEED or HAVE (it already holds v or newer)
                             DONE             DONE_OK or DONE_BAD, once v is verified

The header, which says what to fetch and where to answer, carries the run's HMAC tag
and the receiver's own address: one without a valid tag, or meant for another relay, is
refused and logged (its sender then times out). The chunks are covered by their xxh3
checksums only: bulk bytes are not MAC'ed.

On one host UCX moves chunks with a single-copy CMA read (process_vm_readv) by the
receiver; across hosts, with whatever the network offers (RDMA, TCP).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import random
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from fnrl.config import RelayConfig
from fnrl.relay import store
from fnrl.relay.store import Held
from fnrl.shell import auth

log = logging.getLogger("fnrl.relay")


class Relay(Protocol):
    """What the data plane needs of its relay (fnrl.relay.role.Relay): the held
    versions, the chain, and the relay's event loop."""

    name: str
    cfg: RelayConfig
    chain: dict[str, Any]
    filling: Held | None
    complete: list[Held]

    def newest_version(self) -> int: ...
    def begin(self, layout: store.VersionManifest) -> Held: ...
    def abort(self, held: Held, why: str) -> None: ...
    def finish(self, held: Held) -> None: ...
    def spawn(self, coro: Awaitable) -> Any: ...
    async def notify(self) -> None: ...
    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool: ...


PREAMBLE_TAG = 1
HEADER, NEED, DONE, SUM = 1, 2, 3, 16  # DATA of chunk i is SUM + 2i + 1
NEED_IT, HAVE_IT, DONE_OK, DONE_BAD = 1, 2, 3, 4
MAX_HEADER_BYTES = 64 << 20
"""A version's layout names every tensor: megabytes for a large mixture of experts."""
SENDS_IN_FLIGHT = 2
"""Chunks a sender keeps posted per hop: chunk i+1 is announced while chunk i is still
being read, so the receiver starts on it the moment chunk i lands."""


def _tag(session: int, kind: int) -> int:
    return (session << 24) | kind


class Aborted(RuntimeError):
    """A version being filled was abandoned (its upstream died or a newer one replaced it)."""


class DataPlane:
    """Receives versions from upstream relays and forwards them to the downstream one.

    It fills and reads the versions of its `relay` (`begin`, `abort`, `finish`,
    `filling`, `complete`) and follows the relay's chain (`relay.chain["downstream"]`).
    """

    def __init__(self, relay: Relay):
        import ucxx  # imported here: UCX starts its progress thread on first use

        # Python futures completed by ucxx's notifier thread. The default makes every
        # pending receive spin on the event loop (wait_yield): ~35% of a core per idle relay.
        ucxx.init(progress_mode="thread", enable_python_future=True)
        self.ucxx = ucxx
        self.relay, self.cfg = relay, relay.cfg
        self.address = bytes(ucxx.get_worker_address()).hex()
        self._endpoints: dict[str, object] = {}
        self.sent: tuple[str, int] | None = None
        """(downstream UCX address, newest version it is known to hold)."""

    def forwarded(self, version: int) -> bool:
        """This relay's part of broadcasting `version` is done: its downstream holds it
        (or it has none)."""
        down = self.relay.chain["downstream"]
        return down is None or (self.sent is not None and self.sent[0] == down["ucx_address"]
                                and self.sent[1] >= version)

    # --- messages -------------------------------------------------------------------

    async def _endpoint(self, address_hex: str):
        ep = self._endpoints.get(address_hex)
        if ep is None:
            address = self.ucxx.get_ucx_address_from_buffer(bytes.fromhex(address_hex))
            ep = await asyncio.wait_for(self.ucxx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=self.cfg.ucx_error_handling),
                self.cfg.chunk_timeout_s)
            self._endpoints[address_hex] = ep
        return ep

    def drop_endpoint(self, address_hex: str) -> None:
        ep = self._endpoints.pop(address_hex, None)
        if ep is not None:
            try:
                ep.abort()
            except Exception:  # noqa: BLE001 - the peer is gone either way
                pass

    def _post_send(self, ep, buf: np.ndarray, tag: int) -> asyncio.Future:
        return asyncio.ensure_future(ep.send(buf, tag=tag, force_tag=True))

    def _post_recv(self, buf: np.ndarray, tag: int) -> asyncio.Future:
        return asyncio.ensure_future(self.ucxx.recv(buf, tag=tag))

    async def _within(self, future: asyncio.Future, what: str, timeout_s: float | None = None):
        """The result of a posted message, or TimeoutError naming it. `asyncio.wait`
        rather than `wait_for`: no extra task per chunk."""
        done, _ = await asyncio.wait({future}, timeout=timeout_s or self.cfg.chunk_timeout_s)
        if not done:
            future.cancel()
            raise TimeoutError(f"{what}: no completion in {timeout_s or self.cfg.chunk_timeout_s:g} s")
        return future.result()

    async def _send(self, ep, buf: np.ndarray, tag: int, what: str) -> None:
        await self._within(self._post_send(ep, buf, tag), what)

    # --- receiving --------------------------------------------------------------------

    async def accept(self) -> None:
        """Forever: take transfers from upstream relays, one preamble at a time."""
        while True:
            preamble = np.empty(2, np.uint64)
            await self.ucxx.recv(preamble, tag=PREAMBLE_TAG)
            self.relay.spawn(self._receive(int(preamble[0]), int(preamble[1])))

    async def _receive(self, session: int, header_len: int) -> None:
        relay, held = self.relay, None
        if header_len > MAX_HEADER_BYTES:   # the preamble is not sealed: bound what it asks
            auth.process_auth().note_refused(f"relay {relay.name} UCX", f"session {session:x}",
                                             auth.Refused(f"a {header_len}-byte header"))
            return
        try:
            raw = np.empty(header_len, np.uint8)
            await self._within(self._post_recv(raw, _tag(session, HEADER)), "header")
            authn, sealed = auth.process_auth(), raw.tobytes()
            try:
                header, _ = authn.open([sealed[:auth.TAG_LEN], sealed[auth.TAG_LEN:]])
                if header.get("to") != self.address:
                    raise auth.Refused("meant for another relay")
            except auth.Refused as err:
                authn.note_refused(f"relay {relay.name} UCX", f"session {session:x}", err)
                return
            layout = store.VersionManifest.from_json(json.dumps(header["layout"]))
            reply_to = await self._endpoint(header["reply_to"])
            if layout.version <= relay.newest_version() and not (
                    relay.filling is not None and relay.filling.version == layout.version):
                await self._send(reply_to, np.array([HAVE_IT], np.uint64), _tag(session, NEED),
                                 "have-it reply")
                return
            held = relay.begin(layout)
            if held.manifest.chunk_bytes != layout.chunk_bytes:
                held.manifest = dataclasses.replace(held.manifest, chunk_bytes=layout.chunk_bytes)
            n = held.manifest.num_chunks
            # Every receive is posted before the upstream may send: chunk i+1 lands (UCX's
            # progress thread copies it) while chunk i is verified and forwarded.
            sums = np.empty(n, np.uint64)
            posted = [(self._post_recv(sums[i : i + 1], _tag(session, SUM + 2 * i)),
                       self._post_recv(held.chunk(i), _tag(session, SUM + 2 * i + 1)))
                      for i in range(n)]
            await self._send(reply_to, np.array([NEED_IT], np.uint64), _tag(session, NEED),
                             "need-it reply")
            try:
                for i, (sum_req, data_req) in enumerate(posted):
                    await self._within(sum_req, f"checksum of chunk {i}")
                    await self._within(data_req, f"chunk {i}")
                    if held.state != "filling":
                        return
                    got = await asyncio.to_thread(store.checksum, held.chunk(i))
                    if got != int(sums[i]):
                        relay.abort(held, f"chunk {i} checksum mismatch from {header['sender']}")
                        await self._send(reply_to, np.array([DONE_BAD], np.uint64),
                                         _tag(session, DONE), "done reply")
                        return
                    held.sums.append(got)
                    held.ready += 1
                    await relay.notify()
            finally:
                for reqs in posted:
                    for r in reqs:
                        r.cancel()
            relay.finish(held)
            await relay.notify()
            await self._send(reply_to, np.array([DONE_OK], np.uint64), _tag(session, DONE),
                             "done reply")
        except Exception as e:  # noqa: BLE001 - a failed transfer must not kill the relay
            if held is not None and held.state == "filling":
                relay.abort(held, f"receive failed: {type(e).__name__}: {e}")
                await relay.notify()
            else:
                log.warning("session %x failed: %s: %s", session, type(e).__name__, e)

    # --- forwarding -------------------------------------------------------------------

    def _source(self) -> Held | None:
        """What the downstream should get next: the newest version held or being filled,
        if the downstream is not already known to hold it."""
        relay = self.relay
        if relay.chain["downstream"] is None:
            return None
        candidates = [h for h in (relay.filling, *relay.complete[-1:]) if h is not None]
        if not candidates:
            return None
        src = max(candidates, key=lambda h: h.version)
        return None if self.forwarded(src.version) else src

    async def forward(self) -> None:
        """Forever: stream the newest version to the current downstream neighbour. A
        stream to a neighbour that the controller has since spliced out is cancelled."""
        relay = self.relay
        while True:
            await relay.wait_until(lambda: self._source() is not None, 1.0)
            src, down = self._source(), relay.chain["downstream"]
            if src is None:
                continue
            address = down["ucx_address"]
            stream = asyncio.create_task(self._stream(src, address))
            stream.add_done_callback(lambda _: asyncio.ensure_future(relay.notify()))
            moved = lambda: (relay.chain["downstream"] or {}).get("ucx_address") != address  # noqa: E731
            while not stream.done() and not moved():
                await relay.wait_until(lambda: stream.done() or moved(), 1.0)
            if not stream.done():
                stream.cancel()
                self.drop_endpoint(address)
                log.info("stopped forwarding version %d to %s: chain changed", src.version,
                         down["name"])
                continue
            try:
                stream.result()
                self.sent = (address, src.version)
                await relay.notify()
            except Exception as e:  # noqa: BLE001 - retried, or superseded by a repair
                log.warning("forwarding version %d to %s failed: %s: %s", src.version,
                            down["name"], type(e).__name__, e)
                self.drop_endpoint(address)
                await asyncio.sleep(0.2)

    async def _sent_chunk(self, sends: tuple[asyncio.Future, asyncio.Future], i: int) -> None:
        for future in sends:
            await self._within(future, f"chunk {i}")

    async def _stream(self, src: Held, address: str) -> None:
        """Send one version in one session; returns once the downstream holds it verified."""
        ep = await self._endpoint(address)
        session = random.getrandbits(39) | (1 << 39)
        layout = dataclasses.replace(src.manifest, checksums=())
        tag, raw = auth.process_auth().seal({
            "layout": layout.json_dict, "sender": self.relay.name,
            "reply_to": self.address, "to": address})[0]
        header = tag + raw
        reply, done = np.zeros(1, np.uint64), np.zeros(1, np.uint64)
        need = self._post_recv(reply, _tag(session, NEED))
        posted: collections.deque = collections.deque()
        done_req = None
        try:
            await self._send(ep, np.array([session, len(header)], np.uint64), PREAMBLE_TAG,
                             "preamble")
            await self._send(ep, np.frombuffer(header, np.uint8), _tag(session, HEADER), "header")
            await self._within(need, "need-it reply")
            if int(reply[0]) == HAVE_IT:
                return
            done_req = self._post_recv(done, _tag(session, DONE))
            for i in range(layout.num_chunks):
                if not await self.relay.wait_until(lambda: src.ready > i or src.state == "aborted",
                                                   self.cfg.chunk_timeout_s):
                    raise TimeoutError(f"chunk {i} of version {src.version} not ready in time")
                if src.ready <= i:
                    raise Aborted(f"version {src.version} was abandoned here")
                while len(posted) >= SENDS_IN_FLIGHT:
                    await self._sent_chunk(posted.popleft(), i - SENDS_IN_FLIGHT)
                posted.append((
                    self._post_send(ep, np.array([src.sums[i]], np.uint64), _tag(session, SUM + 2 * i)),
                    self._post_send(ep, src.chunk(i), _tag(session, SUM + 2 * i + 1))))
            while posted:
                await self._sent_chunk(posted.popleft(), layout.num_chunks - len(posted) - 1)
            await self._within(done_req, "done reply", self.cfg.chunk_timeout_s * 2)
        finally:
            for future in (need, done_req, *(f for pair in posted for f in pair)):
                if future is not None:
                    future.cancel()
        if int(done[0]) != DONE_OK:
            raise RuntimeError(f"downstream rejected version {src.version} (checksum)")
