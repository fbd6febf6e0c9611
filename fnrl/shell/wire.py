"""ZeroMQ messages between the controller and the role processes.

A message is a JSON header frame followed by one raw frame per numpy array, sent
without copies. Every receive has a timeout, and the waiting side checks that the
peer process is still alive, so a dead role turns into an error, never a hang.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any, Mapping

import numpy as np
import zmq

from fnrl.shell.files import log_tail
from fnrl.shell.procs import exit_reason


class RoleError(RuntimeError):
    """A role process died or answered with an error; the message names the role."""


def send(sock: zmq.Socket, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None):
    arrays = arrays or {}
    specs = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()]
    frames = [json.dumps({**header, "_arrays": specs}).encode()]
    frames += [np.ascontiguousarray(v).data for v in arrays.values()]
    sock.send_multipart(frames, copy=False)


def decode(frames: list) -> tuple[dict, dict[str, np.ndarray]]:
    header = json.loads(bytes(frames[0]))
    specs = header.pop("_arrays", [])
    arrays = {s["name"]: np.frombuffer(f, dtype=s["dtype"]).reshape(s["shape"])
              for s, f in zip(specs, frames[1:])}
    return header, arrays


def recv(sock: zmq.Socket, *, timeout_s: float, role: str,
         proc: subprocess.Popen | None = None, log_path: str | None = None) -> tuple[dict, dict]:
    """Waits for one message, polling the peer process so that its death is reported."""
    waited = 0.0
    while waited < timeout_s:
        if sock.poll(200):
            header, arrays = decode(sock.recv_multipart(copy=False))
            if header.get("error"):
                raise RoleError(f"{role} failed:\n{header['error']}")
            return header, arrays
        waited += 0.2
        if proc is not None and proc.poll() is not None:
            raise RoleError(f"{role} {exit_reason(proc)}{log_tail(log_path)}")
    raise RoleError(f"{role} did not answer within {timeout_s:.0f}s")


class RoleClient:
    """Request/reply with one role process over a REQ socket, watching the process."""

    def __init__(self, name: str, address: str, proc: subprocess.Popen | None = None,
                 log_path: str | None = None):
        self.name, self.address, self.proc, self.log_path = name, address, proc, log_path
        self._sock = zmq.Context.instance().socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    def call(self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None, *,
             timeout_s: float) -> dict:
        """Blocking; from asyncio, run it with `asyncio.to_thread` (one call at a time)."""
        send(self._sock, header, arrays)
        reply, _ = recv(self._sock, timeout_s=timeout_s, role=self.name, proc=self.proc,
                        log_path=self.log_path)
        return reply

    def close(self) -> None:
        self._sock.close()
