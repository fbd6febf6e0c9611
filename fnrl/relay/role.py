"""The relay role: one process per host holding the newest weight versions in /dev/shm.

    python -m fnrl.relay.role --address tcp://127.0.0.1:5555 --name host0

Requests arrive on a ZeroMQ ROUTER socket (clients use REQ). Each request is a JSON
header frame, for `publish` followed by one raw-bytes frame per tensor. Every reply is
one JSON frame, `{"ok": true, ...}` or `{"ok": false, "error": "..."}`:

    {"op": "ping"}                         -> {"ok", "name", "pid", "version"}
    {"op": "latest"}                       -> {"ok", "manifest": manifest-or-null}
    {"op": "publish", "version": v,
     "tensors": [{"name", "shape", "dtype"}, ...]} + frames -> {"ok", "manifest"}

A publish is answered only after its segment is fully written and is the latest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
from collections.abc import Sequence

import tyro
import zmq

from fnrl.relay import store

log = logging.getLogger("fnrl.relay")

_NAME_RE = re.compile(r"^[A-Za-z0-9_.]+$")
_KEEP = 2  # newest complete version plus the previous one, for readers mid-open


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayArgs:
    """Command line of the relay role."""

    address: str
    """ZeroMQ address to bind, e.g. tcp://127.0.0.1:5555 or ipc:///tmp/relay0."""
    name: str
    """Relay name; part of its segment names, so relays on one host must differ."""

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


class Relay:
    """The relay's state: its complete versions, newest last. All I/O is in `serve`."""

    def __init__(self, name: str):
        self.name = name
        self.pid = os.getpid()
        self.versions: list[store.VersionManifest] = []

    @property
    def latest(self) -> store.VersionManifest | None:
        return self.versions[-1] if self.versions else None

    def handle(self, header: dict, payload: Sequence[zmq.Frame]) -> dict:
        op = header.get("op")
        if op == "ping":
            latest = self.latest
            version = latest.version if latest else None
            return {"ok": True, "name": self.name, "pid": self.pid, "version": version}
        if op == "latest":
            latest = self.latest
            return {"ok": True, "manifest": json.loads(latest.to_json()) if latest else None}
        if op == "publish":
            return self.publish(header, payload)
        return {"ok": False, "error": f"unknown op {op!r}"}

    def publish(self, header: dict, payload: Sequence[zmq.Frame]) -> dict:
        version = int(header["version"])
        latest = self.latest
        if latest is not None and version <= latest.version:
            return {
                "ok": False,
                "error": f"version {version} is not newer than latest {latest.version}",
            }
        manifest = store.plan_layout(
            version=version,
            segment=segment_name(self.name, self.pid, version),
            tensors=[(t["name"], tuple(t["shape"]), t["dtype"]) for t in header["tensors"]],
        )
        if len(payload) != len(manifest.tensors):
            return {
                "ok": False,
                "error": f"version {version}: {len(manifest.tensors)} tensor specs "
                f"but {len(payload)} data frames",
            }
        for spec, frame in zip(manifest.tensors, payload):
            if len(frame) != spec.nbytes:
                return {
                    "ok": False,
                    "error": f"version {version}: tensor {spec.name} has {len(frame)} "
                    f"bytes, expected {spec.nbytes} for {spec.dtype}{list(spec.shape)}",
                }
        self._write(manifest, payload)
        # Visible only now, after every byte is in place.
        self.versions.append(manifest)
        for old in self.versions[:-_KEEP]:
            store.unlink_segment(old.segment)
        self.versions = self.versions[-_KEEP:]
        return {"ok": True, "manifest": json.loads(manifest.to_json())}

    def _write(self, manifest: store.VersionManifest, payload: Sequence[zmq.Frame]) -> None:
        mm = store.create_segment(manifest.segment, manifest.total_bytes)
        try:
            for spec, frame in zip(manifest.tensors, payload):
                mm[spec.offset : spec.offset + spec.nbytes] = frame.buffer
        except BaseException:
            store.unlink_segment(manifest.segment)
            raise
        finally:
            mm.close()

    def close(self) -> None:
        for manifest in self.versions:
            store.unlink_segment(manifest.segment)
        self.versions = []


def serve(args: RelayArgs) -> None:
    """Answer requests until SIGTERM or SIGINT, then unlink every segment."""
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for segment in sweep_dead_segments(args.name):
        log.warning("removed segment %s of a dead relay", segment)

    relay = Relay(args.name)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(args.address)
        log.info("relay %s (pid %d) listening on %s", args.name, relay.pid, args.address)
        while not stopping:
            # Short polls so a signal is noticed quickly.
            if not sock.poll(100, zmq.POLLIN):
                continue
            frames = sock.recv_multipart(copy=False)
            # REQ envelope: routing id(s), an empty delimiter, then the request.
            empty = [i for i, f in enumerate(frames) if len(f) == 0]
            split = empty[0] + 1 if empty else 1
            envelope, request = frames[:split], frames[split:]
            try:
                reply = relay.handle(json.loads(request[0].bytes), request[1:])
            except Exception as e:  # a bad request must not kill the relay
                log.exception("request failed")
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            sock.send_multipart([*envelope, json.dumps(reply).encode()])
    finally:
        relay.close()
        sock.close()
        ctx.term()
        log.info("relay %s stopped; segments unlinked", args.name)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(tyro.cli(RelayArgs))


if __name__ == "__main__":
    main()
