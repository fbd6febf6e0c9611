"""Process 0 of a trainer group hands every command to the other processes.

Only process 0 answers the controller; the others must still enter every step, save,
restore and gather with it, in the same order (each is a collective over the global
mesh). Process 0 sends each command, and the batch with it, to every other process over
ZeroMQ PUSH -> PULL on the group's node (fnrl.trainer.group gives the addresses), sealed
with the run's secret like every control message (fnrl.shell.wire, fnrl.shell.auth).

Why not a JAX broadcast: a follower waits for the next command as long as the
controller waits for a batch (minutes, in a long rollout phase), and a collective that
waits that long trips the CPU collectives' timeouts. A socket waits for free.
A PUSH that connects queues what it sends until its peer is there, so a follower that
binds late (still importing JAX) loses nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq

from fnrl.shell import auth, wire


class FanoutError(RuntimeError):
    """A follower got a command it cannot check (another run's, or changed on the way)."""


class CommandFanout:
    """Process 0's side: one PUSH socket per follower, in rank order."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self._socks = []
        for address in addresses:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)   # a shutdown reaches the followers
            sock.connect(address)
            self._socks.append(sock)

    def send(self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None
             ) -> None:
        for sock in self._socks:
            wire.send(sock, header, arrays)

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


class CommandFeed:
    """A follower's side: a PULL socket bound to its address, yielding process 0's
    commands in order."""

    def __init__(self, address: str, *, role: str = "trainer"):
        self.address = address
        self.authn = auth.role_auth(role)
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)

    def recv(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Blocks until process 0's next command; raises FanoutError on one that fails
        its check (nothing else may write to this socket, so the group cannot go on)."""
        frames = self._sock.recv_multipart(copy=False)
        try:
            header, arrays = wire.decode(frames, authn=self.authn)
        except auth.Refused as err:
            raise FanoutError(f"a command on {self.address} failed its check: {err}") from None
        header.pop("_nonce", None)
        return header, arrays

    def close(self) -> None:
        self._sock.close()
