"""Raw ZeroMQ requests for the authentication tests: frames sent as given, unsigned."""

from __future__ import annotations

import zmq


def raw_call(address: str, frames: list, timeout_ms: int = 120_000) -> list[bytes]:
    """Sends `frames` on a fresh REQ socket and returns the reply; fails if none comes
    within `timeout_ms` (a server stuck on a refused request never answers)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "no answer: the server got stuck on a refused request"
        return sock.recv_multipart()
    finally:
        sock.close()
