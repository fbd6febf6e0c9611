"""The relay role: one process per host holding the newest weight versions in /dev/shm.

    python -m fnrl.relay.role --address tcp://127.0.0.1:5555 --name host0

Control (ZeroMQ ROUTER; clients use REQ): a JSON header frame, for `publish` followed by
one raw-bytes frame per tensor, sealed with the run's secret (fnrl.shell.auth: a tag
frame first; a `publish`'s tensor bytes are covered by length only). Every reply is one
sealed JSON frame, `{"ok": true, ...}` or `{"ok": false, "error": "..."}`; a request that
fails its check gets an unsigned `{"refused": reason}` and a log line, and the relay
serves on:

    {"op": "ping"}                      -> {"ok", "name", "pid", "version", "ucx_address",
                                            "master", "master_address", "epoch", "downstream"}
    {"op": "latest"}                    -> {"ok", "manifest": manifest-or-null}
    {"op": "latest", "version": v}      -> {"ok", "manifest"}: version v's if it is held
                                           here (one of the newest keep_versions), else null
    {"op": "publish", "version": v, "tensors": [{"name", "shape", "dtype"}, ...]} + frames
                                        -> {"ok", "manifest"} once v is the latest here
    {"op": "reserve", "version": v, "tensors": [...], "avoid": slot-or-null}
                                        -> {"ok", "manifest", "inbox_slots"}: an inbox slot
                                           to write v into (another than `avoid` if it can)
    {"op": "commit", "version": v, "segment": slot, "tensors": [...],
     "wait": "held" | "visible"}        -> {"ok", "version"}
    {"op": "set_chain", "epoch", "master", "master_address", "downstream": {"name",
     "ucx_address"} | null}             -> {"ok"}
    {"op": "wait_version", "version": v, "timeout_s": t} -> {"ok", "version"}

`reserve` + `commit` is the trainer's hand-off: it writes a version straight into a
shared-memory slot it keeps mapped, so its stall is one memory copy plus one message (a
slot, once lent, is written again without asking: the tensors are laid out by
`store.plan_layout` on both sides). "held" answers at once (once the version handed off
before is copied in); the relay then copies the slot into the version's own segment under
an exclusive `flock` of the slot, which the trainer takes before it writes it again.

Data (UCX, between relays): `fnrl.relay.data_plane` streams each version down the
chain in pipelined, checksummed chunks; a version becomes visible here only once every
chunk is written and verified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import logging
import mmap
import os
import re
import signal
from collections.abc import Sequence

import numpy as np
import tyro
import zmq
import zmq.asyncio

from fnrl.config import RelayConfig
from fnrl.config.cluster import is_loopback
from fnrl.relay import store
from fnrl.relay.data_plane import DataPlane
from fnrl.relay.store import Held
from fnrl.shell import auth

log = logging.getLogger("fnrl.relay")

_NAME_RE = re.compile(r"^[A-Za-z0-9_.]+$")
PREAMBLE_TAG = 1
HEADER, NEED, DONE, SUM = 1, 2, 3, 16  # DATA of chunk i is SUM + 2i + 1
NEED_IT, HAVE_IT, DONE_OK, DONE_BAD = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayArgs:
    """Command line of the relay role."""

    address: str
    """ZeroMQ address to bind, e.g. tcp://127.0.0.1:5555 or ipc:///tmp/relay0."""
    name: str
    """Relay name; part of its segment names, so relays on one host must differ."""
    cfg: RelayConfig = RelayConfig()
    parent_pid: int = 0
    """Stop (unlinking every segment) once this process is no longer the relay's parent,
    e.g. killed with SIGKILL; 0: never. `launch_relay` passes its own pid, so a relay
    started from any thread of a process that dies without stopping it does not outlive
    it (PR_SET_PDEATHSIG follows the spawning thread, not the process)."""

    def __post_init__(self):
        if not _NAME_RE.match(self.name):
            raise ValueError(f"name={self.name!r}: use letters, digits, '_' and '.'")


def segment_prefix(name: str) -> str:
    return f"fnrl-relay-{name}-"


def segment_name(name: str, pid: int, version: int) -> str:
    return f"{segment_prefix(name)}{pid}-v{version}"


def sweep_dead_segments(name: str) -> list[str]:
    """Unlink segments left by earlier relays of this name whose process is gone.

    A SIGKILLed relay cannot clean up, so its restarted successor does it.
    """
    removed = []
    for path in store.SHM_DIR.glob(segment_prefix(name) + "*"):
        pid = path.name[len(segment_prefix(name)) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            store.unlink_segment(path.name)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclasses.dataclass(eq=False)
class Slot:
    """An inbox segment lent to the trainer; busy (and locked through `fd`) while its
    content is copied out."""

    segment: str
    size: int  # usable bytes, before the marks (`store.slot_marks`)
    buf: np.ndarray
    fd: int
    marks: np.ndarray
    busy: bool = False


class Relay:
    """One relay's state and protocol; `serve` runs it on an asyncio loop."""

    def __init__(self, name: str, address: str, cfg: RelayConfig):
        self.name, self.address, self.cfg = name, address, cfg
        self.pid = os.getpid()
        self.complete: list[Held] = []
        self.filling: Held | None = None
        self.slots: list[Slot] = []
        self._slot_gen = 0
        self.chain = {"epoch": -1, "master": name, "master_address": address,
                      "downstream": None}
        self.changed = asyncio.Condition()  # notified on any progress or chain change
        self.spare: tuple[str, mmap.mmap] | None = None  # a populated segment for the next version
        self._spare_gen = 0
        self._preparing_spare = False
        self._tasks: set[asyncio.Task] = set()
        self.data = DataPlane(self)

    # --- versions -----------------------------------------------------------------

    @property
    def latest(self) -> store.VersionManifest | None:
        return self.complete[-1].manifest if self.complete else None

    def newest_version(self) -> int:
        """Newest version held or being filled; -1 if none."""
        versions = [h.version for h in self.complete]
        if self.filling is not None:
            versions.append(self.filling.version)
        return max(versions, default=-1)

    def begin(self, layout: store.VersionManifest) -> Held:
        """Start filling a version in a fresh segment, abandoning any other being filled."""
        if self.filling is not None:
            self.abort(self.filling, f"superseded by version {layout.version}")
        segment = segment_name(self.name, self.pid, layout.version)
        store.unlink_segment(segment)  # an abandoned earlier attempt at this version
        manifest = dataclasses.replace(layout, segment=segment, chunk_bytes=self.cfg.chunk_bytes,
                                       checksums=())
        spare, self.spare = self.spare, None
        if spare is not None and len(spare[1]) >= max(manifest.total_bytes, store.ALIGNMENT):
            store.rename_segment(spare[0], segment)
            mm = spare[1]
        else:  # no spare of the right size yet: fault pages in while filling (slower)
            if spare is not None:
                store.unlink_segment(spare[0])
            mm = store.create_segment(segment, manifest.total_bytes)
        held = Held(manifest=manifest, mm=mm, buf=np.frombuffer(mm, np.uint8))
        self.filling = held
        return held

    def abort(self, held: Held, why: str) -> None:
        if held.state == "aborted":  # its name is gone, and may be a retried attempt's now
            return
        log.warning("version %d abandoned: %s", held.version, why)
        held.state = "aborted"
        if self.filling is held:
            self.filling = None
        # Unlink only: a UCX receive may still be posted into the mapping (left to the GC).
        store.unlink_segment(held.manifest.segment)

    def finish(self, held: Held) -> None:
        """Make a filled, verified version visible; retire versions beyond `keep_versions`."""
        if held.state == "aborted":   # abandoned while its last chunk was checked: its
            return                      # name is gone, readers would find no segment
        held.manifest = dataclasses.replace(held.manifest, checksums=tuple(held.sums))
        held.state = "complete"
        if self.filling is held:
            self.filling = None
        if self.latest is not None and held.version <= self.latest.version:
            self.spawn(self._retire([held], None))
            return
        self.complete.append(held)
        dropped = self.complete[: -self.cfg.keep_versions]
        self.complete = self.complete[-self.cfg.keep_versions :]
        log.info("version %d visible (%d bytes, %d chunks)", held.version,
                 held.manifest.total_bytes, len(held.sums))
        self.spawn(self._retire(dropped, held))

    def _spare_name(self) -> str:
        self._spare_gen += 1
        return f"{segment_prefix(self.name)}{self.pid}-spare{self._spare_gen}"

    async def _retire(self, dropped: list[Held], newest: Held | None) -> None:
        """Take the version names of `dropped` away now (new readers ask for `latest`),
        then, once this relay's part of broadcasting `newest` is done (its downstream
        holds it; sooner, this work would slow a chain sharing the host), keep one as
        the spare for the next version if no reader maps it, unmap the others, and
        populate a fresh spare if none could be reused."""
        retired = []
        for old in dropped:
            name = self._spare_name()
            store.rename_segment(old.manifest.segment, name)
            retired.append((name, old))
        if newest is not None:
            await self.wait_until(lambda: self.data.forwarded(newest.version),
                                  self.cfg.chunk_timeout_s)
        for name, old in retired:
            mm, old.mm, old.buf = old.mm, None, None
            if self.spare is None and not self._preparing_spare and newest is not None \
                    and len(mm) >= newest.manifest.total_bytes and not store.has_readers(name):
                self.spare = (name, mm)
            else:
                store.unlink_segment(name)
                await asyncio.to_thread(_unmap, mm)
            del mm
        if newest is None or self.spare is not None or self._preparing_spare:
            await self.notify()
            return
        self._preparing_spare, name = True, self._spare_name()
        try:
            # Sizes rarely change between versions.
            mm = await asyncio.to_thread(store.create_segment, name, newest.manifest.total_bytes,
                                         populate=True)
        finally:
            self._preparing_spare = False
        if self.spare is None:
            self.spare = (name, mm)
        else:
            store.unlink_segment(name)
        await self.notify()

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` as a task this relay cancels when it stops."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate, timeout_s: float) -> bool:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout_s)
                return True
            except TimeoutError:
                return False

    def _check_newer(self, version: int) -> None:
        """A publish must be newer than every complete version. It replaces a version
        still arriving from upstream: a publisher only comes to this relay once it is the
        master, and what an upstream was sending it then is a dead master's."""
        latest = self.latest.version if self.latest else -1
        if version <= latest:
            raise ValueError(f"version {version} is not newer than latest {latest}")

    # --- control requests ---------------------------------------------------------

    async def handle(self, header: dict, payload: Sequence[zmq.Frame]) -> dict:
        op = header.get("op")
        if op == "ping":
            latest = self.latest
            return {"ok": True, "name": self.name, "pid": self.pid,
                    "version": latest.version if latest else None,
                    "ucx_address": self.data.address, "master": self.chain["master"],
                    "master_address": self.chain["master_address"],
                    "epoch": self.chain["epoch"], "downstream": self.chain["downstream"],
                    # Nothing to prepare before the first version (its size is unknown).
                    "spare_ready": self.spare is not None or self.latest is None,
                    "filling": None if self.filling is None else self.filling.version}
        if op == "latest":
            held = self.filling
            if held is not None and held.handed_off:
                # Read-your-writes at the master: a version handed off here is the latest
                # from then on; a reader that asks while it is being copied in waits (about
                # one memory copy) instead of getting the one before.
                await self.wait_until(lambda: held.state != "filling", self.cfg.chunk_timeout_s)
            latest = self.latest
            if header.get("version") is not None:   # a reader pinned to one version
                latest = next((h.manifest for h in self.complete
                               if h.version == int(header["version"])), None)
            return {"ok": True, "manifest": latest.json_dict if latest else None}
        if op == "publish":
            return await self.publish_frames(header, payload)
        if op == "reserve":
            return await self.reserve(header)
        if op == "commit":
            return await self.commit(header)
        if op == "set_chain":
            return await self.set_chain(header)
        if op == "wait_version":
            version = int(header["version"])
            ok = await self.wait_until(
                lambda: self.latest is not None and self.latest.version >= version,
                float(header.get("timeout_s", 10.0)))
            return {"ok": ok, "version": self.latest.version if self.latest else None,
                    **({} if ok else {"error": f"version {version} not visible in time"})}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _layout(self, header: dict, segment: str) -> store.VersionManifest:
        return store.plan_layout(
            version=int(header["version"]), segment=segment,
            tensors=[(t["name"], tuple(t["shape"]), t["dtype"]) for t in header["tensors"]])

    async def publish_frames(self, header: dict, payload: Sequence[zmq.Frame]) -> dict:
        """A version sent as ZeroMQ frames (a publisher on another host)."""
        layout = self._layout(header, "")
        self._check_newer(layout.version)
        if len(payload) != len(layout.tensors):
            return {"ok": False, "error": f"version {layout.version}: {len(layout.tensors)} "
                    f"tensor specs but {len(payload)} data frames"}
        for spec, frame in zip(layout.tensors, payload):
            if len(frame) != spec.nbytes:
                return {"ok": False, "error": f"version {layout.version}: tensor {spec.name} "
                        f"has {len(frame)} bytes, expected {spec.nbytes} for "
                        f"{spec.dtype}{list(spec.shape)}"}
        held = self.begin(layout)
        for spec, frame in zip(layout.tensors, payload):
            held.buf[spec.offset : spec.offset + spec.nbytes] = np.frombuffer(frame.buffer, np.uint8)
        await self._fill_from(held, None)
        return {"ok": True, "manifest": held.manifest.json_dict}

    async def reserve(self, header: dict) -> dict:
        """Lend the publisher a free inbox slot laid out for its tensors."""
        version = int(header["version"])
        self._check_newer(version)
        size = self._layout(header, "").total_bytes
        limit, avoid = self.cfg.inbox_slots, header.get("avoid")
        # Free slots, the one the publisher asks to avoid last: it holds the publisher's
        # last version, which it hands to a new master should this relay die.
        free = lambda: sorted((s for s in self.slots if not s.busy),  # noqa: E731
                              key=lambda s: s.segment == avoid)
        if not free() and len(self.slots) >= limit:
            if not await self.wait_until(lambda: bool(free()), self.cfg.chunk_timeout_s):
                return {"ok": False, "error": "no inbox slot freed in time"}
        fitting = [s for s in free() if s.size >= size]
        if fitting and (fitting[0].segment != avoid or len(self.slots) >= limit):
            slot = fitting[0]
        else:
            if len(self.slots) >= limit:  # replace a free slot that is too small
                small = free()[0]
                self.slots.remove(small)
                store.unlink_segment(small.segment)
                os.close(small.fd)
            self._slot_gen += 1
            segment = f"{segment_prefix(self.name)}{self.pid}-inbox{self._slot_gen}"
            mm = await asyncio.to_thread(store.create_segment, segment,
                                         size + store.SLOT_TAIL, populate=True)
            slot = Slot(segment=segment, size=size, buf=np.frombuffer(mm, np.uint8),
                        fd=os.open(store.SHM_DIR / segment, os.O_RDWR),
                        marks=store.slot_marks(mm))
            slot.marks[:] = -1
            self.slots.append(slot)
        layout = self._layout(header, slot.segment)
        return {"ok": True, "manifest": layout.json_dict, "inbox_slots": limit}

    async def commit(self, header: dict) -> dict:
        """The publisher has written its slot: this relay now holds the version."""
        await self._after_hand_off()
        version, segment = int(header["version"]), header["segment"]
        slot = next((s for s in self.slots if s.segment == segment), None)
        if slot is None or slot.busy:
            return {"ok": False, "error": f"{segment} is not a free inbox slot here"}
        layout = self._layout(header, segment)
        if layout.total_bytes > slot.size:
            return {"ok": False, "error": f"version {version} needs {layout.total_bytes} "
                    f"bytes, inbox slot {segment} has {slot.size}"}
        self._check_newer(version)
        held = self.begin(layout)
        held.handed_off = True
        slot.busy = True
        task = self.spawn(self._fill_from(held, slot))
        if header.get("wait", "visible") == "visible":
            await task
            if held.state != "complete":
                return {"ok": False, "error": f"version {version} was abandoned"}
        return {"ok": True, "version": version}

    async def _after_hand_off(self) -> None:
        """Once no handed-off version is still being copied in (or after the chunk
        timeout): superseded by a next one that may turn out unwritten, it would leave
        this relay without the version it said it held. Checked at every wake-up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.chunk_timeout_s
        while (previous := self.filling) is not None and previous.handed_off:
            if not await self.wait_until(lambda: previous.state != "filling",
                                         max(0.0, deadline - loop.time())):
                return

    async def _fill_from(self, held: Held, slot: Slot | None) -> None:
        """Checksum `held` chunk by chunk (copying it out of `slot` first, if given, once
        its writer has let go of it); the forwarder streams each chunk downstream as soon
        as it is ready."""
        locked = False
        try:
            if slot is not None:
                locked = await self._take_slot(slot, held)
                if not locked:
                    return
            ranges = store.chunk_ranges(held.manifest.total_bytes, held.manifest.chunk_bytes)
            for lo, hi in ranges:
                if held.state != "filling":
                    return
                src = None if slot is None else slot.buf[lo:hi]
                # A thread, so the loop keeps answering: numpy and xxhash drop the GIL.
                held.sums.append(await asyncio.to_thread(_copy_and_sum, src, held.buf[lo:hi]))
                held.ready += 1
                await self.notify()
            self.finish(held)
            await self.notify()
        finally:
            if slot is not None:
                slot.busy = False
                if locked:
                    fcntl.flock(slot.fd, fcntl.LOCK_UN)  # the publisher may write it again
                await self.notify()

    async def _take_slot(self, slot: Slot, held: Held) -> bool:
        """Lock `slot` once its writer has let go; abandon `held` (False) if the writer
        did not finish writing it, or holds on past the chunk timeout."""
        deadline = asyncio.get_running_loop().time() + self.cfg.chunk_timeout_s
        while True:
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if asyncio.get_running_loop().time() > deadline:
                    self.abort(held, "its publisher did not finish writing it in time")
                    return False
                # The publisher is copying (about one memory copy); poll, as a thread
                # blocked in flock could not be called off.
                await asyncio.sleep(100e-6)
        slot.marks[store.SLOT_TAKEN] = held.version
        if slot.marks[store.SLOT_WRITTEN] != held.version:
            self.abort(held, "its publisher stopped before it had written it")
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
            return False
        return True

    async def set_chain(self, header: dict) -> dict:
        if int(header["epoch"]) < self.chain["epoch"]:
            return {"ok": True, "stale": True}
        self.chain = {k: header[k] for k in ("epoch", "master", "master_address", "downstream")}
        log.info("chain epoch %d: master %s, downstream %s", self.chain["epoch"],
                 self.chain["master"], (self.chain["downstream"] or {}).get("name"))
        await self.notify()
        return {"ok": True}

    def close(self) -> None:
        for held in [*self.complete, *([self.filling] if self.filling else [])]:
            store.unlink_segment(held.manifest.segment)
        for slot in self.slots:
            store.unlink_segment(slot.segment)
            os.close(slot.fd)
        if self.spare is not None:
            store.unlink_segment(self.spare[0])
        self.complete, self.filling, self.slots, self.spare = [], None, [], None


def _unmap(mm: mmap.mmap) -> None:
    """Unmap a retired segment; run in a thread, where the unmap (freeing the pages
    unless a reader still maps them, ~0.2 ms per MB) leaves the event loop alone."""
    try:
        mm.close()
    except BufferError:  # a view is still in use: the mapping goes with it
        pass


def _copy_and_sum(src: np.ndarray | None, dst: np.ndarray) -> int:
    if src is not None:
        np.copyto(dst, src)
    return store.checksum(dst)


async def _serve(args: RelayArgs) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    for segment in sweep_dead_segments(args.name):
        log.warning("removed segment %s of a dead relay", segment)

    authn = auth.role_auth(f"relay {args.name}")
    relay = Relay(args.name, args.address, args.cfg)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    background = [asyncio.create_task(relay.data.accept()),
                  asyncio.create_task(relay.data.forward())]

    async def answer(envelope, header: dict, payload) -> None:
        nonce = header.pop("_nonce")
        try:
            reply = await relay.handle(header, payload)
        except Exception as e:  # a bad request must not kill the relay
            log.exception("request failed")
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sealed, _ = authn.seal(reply, reply_to=nonce)
        await sock.send_multipart([*envelope, *sealed])

    try:
        sock.bind(args.address)
        log.info("relay %s (pid %d) listening on %s", args.name, relay.pid, args.address)
        while not stopping.is_set():
            # Short polls so a signal, or the parent's death, is noticed quickly.
            if args.parent_pid and os.getppid() != args.parent_pid:
                log.warning("relay %s: parent %d is gone; stopping", args.name,
                            args.parent_pid)
                break
            if not await sock.poll(100, zmq.POLLIN):
                continue
            frames = await sock.recv_multipart(copy=False)
            # REQ envelope: routing id(s), an empty delimiter, then the request.
            empty = [i for i, f in enumerate(frames) if len(f) == 0]
            split = empty[0] + 1 if empty else 1
            try:
                header, payload = authn.open(frames[split:])
            except auth.Refused as err:
                authn.note_refused(f"relay {args.name} {args.address}",
                                   auth.peer_of(frames[-1]), err)
                await sock.send_multipart([*frames[:split], *auth.refusal(str(err))])
                continue
            relay.spawn(answer(frames[:split], header, payload))
    finally:
        for task in [*background, *relay._tasks]:
            task.cancel()
        relay.close()
        sock.close()
        ctx.term()
        log.info("relay %s stopped; segments unlinked", args.name)


def serve(args: RelayArgs) -> None:
    """Answer requests and forward versions until SIGTERM or SIGINT, then unlink every
    segment. Exits with 1 if it fails (e.g. its address is taken)."""
    code = 0
    try:
        asyncio.run(_serve(args))
    except BaseException:  # noqa: BLE001 - logged; the exit code tells the launcher
        log.exception("relay %s failed", args.name)
        code = 1
    # A spare segment whose creation was still running in a thread at shutdown.
    for path in store.SHM_DIR.glob(f"{segment_prefix(args.name)}{os.getpid()}-*"):
        store.unlink_segment(path.name)
    # UCX's progress thread keeps the interpreter from exiting; all state is gone.
    logging.shutdown()
    os._exit(code)


def ucx_environment(address: str, environ=os.environ) -> None:
    """UCX's settings for a relay at ZeroMQ `address`, set before UCX starts. A relay
    on loopback (every relay of a one-machine job) keeps UCX on loopback too: its TCP
    transport would otherwise listen on every interface of the host. A relay that
    other machines reach is left to UCX's defaults (or the user's UCX_NET_DEVICES)."""
    environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if is_loopback(host):
        environ.setdefault("UCX_NET_DEVICES", "lo")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = tyro.cli(RelayArgs)
    ucx_environment(args.address)
    serve(args)


if __name__ == "__main__":
    main()
