"""ZeroMQ messages between the controller and the role processes.

A message is a tag frame, a JSON header frame, then one raw frame per numpy array, sent
without copies; the tag is an HMAC of the run's secret over all of it (fnrl.shell.auth).
A role answers a message that fails its check with an unsigned refusal and a log line,
and serves on; a client raises RoleError on a refusal or on a reply that fails its own
check. Every receive has a timeout, and the waiting side checks that the peer process is
still alive, so a dead role turns into an error, never a hang.
"""

from __future__ import annotations

import subprocess
from typing import Any, Mapping

import numpy as np
import zmq

from fnrl.shell import auth
from fnrl.shell.files import DiskFull, log_tail
from fnrl.shell.procs import exit_reason
from fnrl.types import ClusterLost, NodeLost, RoleError  # noqa: F401 - re-exported


def send(sock: zmq.Socket, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None,
         *, reply_to: str | None = None, authn: auth.Authenticator | None = None) -> str:
    """Sends a sealed message (a reply to the request whose nonce is `reply_to`, if
    given); returns its nonce, which its reply must name."""
    arrays = arrays or {}
    specs = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()]
    # Raw bytes views: zero-copy, and any dtype (bfloat16 has no buffer format).
    frames = [np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in arrays.values()]
    sealed, nonce = (authn or auth.process_auth()).seal({**header, "_arrays": specs}, frames,
                                                        reply_to=reply_to)
    sock.send_multipart(sealed, copy=False)
    return nonce


def decode(frames: list, *, reply_to: str | None = None,
           authn: auth.Authenticator | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and arrays of a message that passes its check; raises auth.Refused."""
    header, data = (authn or auth.process_auth()).open(frames, reply_to=reply_to)
    specs = header.pop("_arrays", [])
    arrays = {s["name"]: np.frombuffer(f, dtype=s["dtype"]).reshape(s["shape"])
              for s, f in zip(specs, data)}
    return header, arrays


def recv(sock: zmq.Socket, *, timeout_s: float, role: str, reply_to: str | None = None,
         proc: subprocess.Popen | None = None, log_path: str | None = None,
         authn: auth.Authenticator | None = None) -> tuple[dict, dict]:
    """Waits for one message (the reply to the request whose nonce is `reply_to`, if
    given), polling the peer process so that its death is reported."""
    waited = 0.0
    while waited < timeout_s:
        if sock.poll(200):
            frames = sock.recv_multipart(copy=False)
            try:
                header, arrays = decode(frames, reply_to=reply_to, authn=authn)
            except auth.Refused as err:
                reason = auth.refusal_reason(frames)
                if reason is not None:
                    raise RoleError(f"{role} refused our message: {reason}") from None
                raise RoleError(f"{role}'s reply refused: {err}") from None
            if header.get("no_space"):   # a full disk: no restart makes room
                raise DiskFull(f"{role} was writing", log_path or ".", header["no_space"])
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
        nonce = send(self._sock, header, arrays)
        reply, _ = recv(self._sock, timeout_s=timeout_s, role=self.name, reply_to=nonce,
                        proc=self.proc, log_path=self.log_path)
        return reply

    def close(self) -> None:
        self._sock.close()


class RoleServer:
    """The role's side: a REP socket bound to `address` that hands out only requests
    that pass their check. One that fails is answered with a refusal and logged (one
    line naming the peer and the reason), and the next is awaited: the socket never
    waits for a reply it cannot send."""

    def __init__(self, address: str, *, role: str, authn: auth.Authenticator | None = None):
        self.address, self.role = address, role
        self.authn = authn or auth.role_auth(role)
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._nonce: str | None = None

    def recv(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Blocks until an authentic request arrives; its header and arrays."""
        while True:
            frames = self._sock.recv_multipart(copy=False)
            try:
                header, arrays = decode(frames, authn=self.authn)
            except auth.Refused as err:
                self.authn.note_refused(f"{self.role} {self.address}", auth.peer_of(frames[0]), err)
                self._sock.send_multipart(auth.refusal(str(err)))
                continue
            self._nonce = header.pop("_nonce")
            return header, arrays

    def reply(self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> None:
        """Answers the request `recv` returned last."""
        send(self._sock, header, arrays, reply_to=self._nonce, authn=self.authn)

    def close(self) -> None:
        self._sock.close()
