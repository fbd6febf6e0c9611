"""Client of the relay role (`fnrl.relay.role`): publish a version, ask for the latest."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import zmq

from fnrl.relay.store import VersionManifest


class RelayError(RuntimeError):
    """The relay answered with an error, or did not answer in time."""


class RelayTimeout(RelayError):
    """The relay did not answer within the timeout (dead, hung or unreachable)."""


class RelayClient:
    """Blocking request/reply client of one relay; every call has a timeout.

    After a timeout the socket is thrown away and the next call opens a fresh one
    (ZeroMQ's "lazy pirate" pattern), so a late reply can never be mistaken for the
    answer to a later request.
    """

    def __init__(self, address: str, *, timeout_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def publish(
        self,
        version: int,
        tensors: Mapping[str, np.ndarray],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Send one complete version; returns once the relay serves it as latest."""
        arrays = {name: _c_contiguous(a) for name, a in tensors.items()}
        header = {
            "op": "publish",
            "version": int(version),
            "tensors": [
                {"name": name, "shape": list(a.shape), "dtype": str(a.dtype)}
                for name, a in arrays.items()
            ],
        }
        # Raw bytes views: zero-copy, and dtype-agnostic (bfloat16 has no buffer format).
        frames = [a.reshape(-1).view(np.uint8) for a in arrays.values()]
        self._request(header, frames, timeout_s)

    def latest(self, *, timeout_s: float | None = None) -> VersionManifest | None:
        """The manifest of the newest complete version, or None if nothing is published."""
        manifest = self._request({"op": "latest"}, [], timeout_s)["manifest"]
        return None if manifest is None else VersionManifest.from_json(json.dumps(manifest))

    def ping(self, *, timeout_s: float | None = None) -> dict:
        """`{"name", "pid", "version"}` of the relay."""
        reply = self._request({"op": "ping"}, [], timeout_s)
        return {k: reply[k] for k in ("name", "pid", "version")}

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

    def _request(self, header: dict, frames: list, timeout_s: float | None) -> dict:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        op = header["op"]
        sock = self._socket()
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        try:
            # copy=False hands the arrays' memory to ZeroMQ without copying; the reply
            # comes only after the relay has read every frame, so the arrays are free
            # to change once this returns.
            sock.send_multipart([json.dumps(header).encode(), *frames], copy=False)
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise zmq.Again()
            reply = json.loads(sock.recv())
        except zmq.Again:
            self.close()
            raise RelayTimeout(
                f"relay {self.address} did not answer {op!r} within {timeout_s:g} s"
            ) from None
        if not reply.get("ok"):
            raise RelayError(f"relay {self.address} refused {op!r}: {reply.get('error')}")
        return reply


def _c_contiguous(a: np.ndarray) -> np.ndarray:
    """`a` itself when already C-contiguous (the usual case: no copy), else a copy.

    Not np.ascontiguousarray, which turns 0-d arrays into 1-d ones.
    """
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")
