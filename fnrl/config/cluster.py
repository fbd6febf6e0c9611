"""Where the job's roles listen (fnrl.backends.roles, fnrl.serving.server)."""

from __future__ import annotations

import dataclasses
import ipaddress

from fnrl.config.base import check

LOOPBACK = "127.0.0.1"


def is_host(host: str) -> bool:
    """Whether `host` is an IP address or a host name (RFC 1123 labels)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.split(".")
    return 0 < len(host) <= 253 and all(
        0 < len(label) <= 63 and label.isascii() and label.replace("-", "").isalnum()
        and not label.startswith("-") and not label.endswith("-") for label in labels)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this host only: a loopback address or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the roles listen. Nothing listens beyond loopback unless asked."""

    bind_host: str = LOOPBACK
    """Address the vLLM servers bind. Loopback by default; any other (the node's address
    when the cluster spans nodes, or 0.0.0.0) makes each server require the run's API key
    on every path but /health (fnrl.serving.http_auth). ZeroMQ control messages are
    authenticated with the run's secret wherever they listen (fnrl.shell.auth)."""
    require_api_key: bool = False
    """Require the API key on loopback too (a host shared with other users, who can reach
    127.0.0.1 and vLLM's /collective_rpc on it)."""
    share_run_dir: bool = False
    """Let the owner's group read the run directory (directories 0750, files 0640). Off:
    owner-only (0700, 0600), like the run's shared-memory segments: checkpoints, batches
    and trajectories are the run's data, and other users of the host need none of it."""

    backend: str = "local"
    """Where roles run: "local" (child processes of the controller on this host; needs no
    Ray) or "ray" (an existing Ray cluster places them on its nodes: fnrl.backends.ray_cluster,
    docs/multinode.md)."""
    ray_address: str = ""
    """The Ray cluster to join, HOST:PORT of its head ("": the RAY_ADDRESS variable, else
    the cluster `ray start` last recorded on this machine)."""
    connect_timeout_s: float = 30.0
    """How long the job waits for the Ray cluster to answer before it refuses to start,
    naming the address and where it came from."""
    trainer_node: str = ""
    """The Ray node the trainer runs on, by its `node_label` value ("": the first by name)."""
    node_label: str = "fnrl-node"
    """The Ray node label that names a node (`ray start --labels fnrl-node=a`); a node
    without it is named by the first 8 characters of its node id."""

    @property
    def file_mask(self) -> int:
        """The umask every process of the run writes under (set by
        fnrl.experiments.math_grpo.run, and by each Ray node's host actor)."""
        return 0o027 if self.share_run_dir else 0o077

    def __post_init__(self):
        check(is_host(self.bind_host), "ClusterConfig", "bind_host", self.bind_host,
              "must be an IP address or a host name")
        check(self.backend in ("local", "ray"), "ClusterConfig", "backend", self.backend,
              "must be 'local' or 'ray'")
        check(self.connect_timeout_s > 0, "ClusterConfig", "connect_timeout_s",
              self.connect_timeout_s, "must be > 0")
