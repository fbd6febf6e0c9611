"""A network namespace of this process's own with only loopback up: a local multi-node
Ray cluster in tests reaches no address but 127.0.0.1, whatever Ray binds or probes
(it listens on every interface and probes 8.8.8.8 for the host's address).

Unprivileged: a user namespace (this user mapped to itself, so files keep their owner)
holds the network namespace. Call it first thing in a fresh process, before any thread
starts (the kernel refuses CLONE_NEWUSER in a multi-threaded process); every process it
starts afterwards inherits the namespace.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def enter_loopback_namespace() -> None:
    """Moves this process into new user and network namespaces and brings `lo` up.
    Raises OSError naming the step the kernel refused."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER | CLONE_NEWNET) refused: {os.strerror(err)} "
                           "(unprivileged user namespaces disabled, or threads running)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    # A new network namespace has lo down: set IFF_UP on it (what `ip link set lo up` does).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def interfaces() -> list[str]:
    """The network interfaces this process sees (only "lo" inside the namespace)."""
    return [name for _, name in socket.if_nameindex()]
