"""Configuration of the relay tier (fnrl.relay)."""

from __future__ import annotations

import dataclasses

from fnrl.config.base import check, positive

MIB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """How many relays, how they chunk and verify versions, and how long anything may wait."""

    num_relays: int = 1
    """Relays in the chain (one per simulated host); the first is the initial master."""
    chunk_bytes: int = 32 * MIB
    """Pipelining and checksum unit of the chain broadcast (Laminar: 32 MB)."""
    keep_versions: int = 2
    """Complete versions a relay keeps mapped: the newest, plus older ones for readers that
    asked `latest` just before a newer version landed. A version being received comes on
    top, so 1 is plain double buffering."""
    inbox_slots: int = 2
    """Shared-memory slots the master lends the trainer for hand-offs (2: the trainer can
    hand off the next version while the master still copies the previous one out)."""
    chunk_timeout_s: float = 10.0
    """Longest wait for one chunk (or one control message) between two relays."""
    heartbeat_s: float = 0.5
    """How often the tier controller pings every relay."""
    heartbeat_timeout_s: float = 2.0
    """Longest wait for one ping's answer."""
    heartbeat_misses: int = 3
    """A relay that misses this many pings in a row is spliced out of the chain (at once
    if its process is known to have exited): one slow answer on a loaded host is not death."""
    ucx_error_handling: bool = False
    """UCX peer error handling. On one host it rules out the shared-memory and CMA
    transports (UCX then falls back to TCP, about 5x slower), so it is off; every UCX
    wait has a timeout instead, which is how a dead peer is noticed. Known defect with it
    off: a relay reading a chunk from its upstream over CMA at the instant that upstream
    is killed is aborted by UCX (process_vm_readv on a dead pid is fatal), so a SIGKILL
    of one relay mid-broadcast can take its downstream with it; the tier splices both out
    (tests/relay/test_broadcast.py, the master's kill)."""

    def __post_init__(self):
        positive(self, "num_relays", "chunk_bytes", "keep_versions", "inbox_slots",
                 "chunk_timeout_s", "heartbeat_s", "heartbeat_timeout_s", "heartbeat_misses")
        # Chunks are checksummed and copied as aligned blocks.
        check(self.chunk_bytes % 64 == 0, "RelayConfig", "chunk_bytes", self.chunk_bytes,
              "use a multiple of 64")
