"""Ports for the role processes of one host."""

from __future__ import annotations

import functools
import random
import socket
from pathlib import Path

from fnrl.shell.files import read_tail

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000
_rng = random.SystemRandom()   # not the global generator, which a job may have seeded


@functools.cache
def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it).

    Drawn at random below the kernel's ephemeral range where there is room (Linux:
    10000-32767): a vLLM server binds its port tens of seconds after it is chosen, and
    in that window every connection and `bind(0)` on the host (vLLM's engine cores'
    among them) takes ports from the ephemeral range, which is where `bind(0)` itself
    would have picked. Servers that still lose the race are restarted on a fresh port
    (fnrl.backends.roles.Cluster.wait_servers_ready)."""
    low = ephemeral_low()
    if low - LOWEST >= 1024:
        for _ in range(64):
            port = _rng.randrange(LOWEST, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(log_path: str | Path, since: int = 0) -> bool:
    """Whether a server's log, from byte `since` on (where its latest start began),
    ends with its bind failing on a port in use."""
    try:
        return b"Address already in use" in read_tail(log_path, since)
    except OSError:
        return False


def connect_error(host: str, port: int, timeout_s: float) -> OSError | None:
    """None when a TCP connection to host:port opens within `timeout_s`, else why not."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return None
    except OSError as err:
        return err


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a TCP socket listening on `port` (in its own network
    namespace); None where /proc cannot tell (not Linux, or the process is gone). A
    readiness probe's answer can come from another server that holds the port (one that
    took it after `free_port` chose it): this tells whether the server is ours."""
    proc = Path(f"/proc/{pid}")
    inodes = set()
    try:
        for table in ("tcp", "tcp6"):
            lines = (proc / "net" / table).read_text().splitlines()[1:]
            for line in lines:
                fields = line.split()
                # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 the inode.
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
        if not inodes:
            return False
        for fd in (proc / "fd").iterdir():
            try:
                if str(fd.readlink()) in inodes:
                    return True
            except OSError:   # closed while listed
                continue
    except (OSError, IndexError, ValueError):
        return None
    return False
