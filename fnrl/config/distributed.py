"""How trainer processes join one global JAX mesh (fnrl.trainer.distributed).

The default is one trainer process, as before: nothing is read from the environment
and `jax.distributed` is never started. `num_processes=0` asks for the launcher's
environment (SLURM's srun variables, or FNRL_* variables set by hand, by a Kubernetes
manifest or by a Ray actor); values given here always win over the environment.
"""

from __future__ import annotations

import dataclasses

from fnrl.config.base import check
from fnrl.config.cluster import is_host

DEFAULT_COORDINATOR_PORT = 8476


def split_host_port(address: str) -> tuple[str, int] | None:
    """("host", port) of "host:port" ("[v6]:port" for IPv6), or None if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if host and is_host(host) else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """The trainer's process group: N JAX processes, each with its local devices, on one
    global mesh (docs/multinode.md)."""

    num_processes: int = 1
    """Trainer processes in the group. 1: one process (no coordinator). 0: from the
    environment (SLURM_NTASKS, else FNRL_NUM_PROCESSES)."""
    process_id: int = -1
    """This process's rank in [0, num_processes); -1: from the environment (SLURM_PROCID,
    else FNRL_PROCESS_ID). Process 0 runs the coordinator."""
    coordinator: str = ""
    """host:port of process 0's coordinator. "": FNRL_COORDINATOR, else the first host
    of SLURM's node list, else 127.0.0.1; at `coordinator_port`."""
    coordinator_port: int = 0
    """The port when `coordinator` gives none; 0: under SLURM one derived from the job
    id (two jobs on a node do not collide), else 8476."""
    local_devices: int = 0
    """CPU only: the devices each process exposes (XLA's forced host device count);
    0 leaves XLA_FLAGS as they are. Accelerators expose their own."""
    init_timeout_s: int = 300
    """How long a process waits for the whole group to join before failing."""

    def __post_init__(self):
        name = "DistributedConfig"
        check(isinstance(self.num_processes, int) and self.num_processes >= 0, name,
              "num_processes", self.num_processes,
              "must be an int >= 0 (1: one process, 0: from the environment)")
        check(isinstance(self.process_id, int) and self.process_id >= -1, name, "process_id",
              self.process_id, "must be an int >= 0, or -1 (from the environment)")
        check(self.num_processes == 0 or self.process_id < self.num_processes, name,
              "process_id", self.process_id,
              f"must be below num_processes={self.num_processes}")
        check(self.coordinator == "" or split_host_port(self.coordinator) is not None, name,
              "coordinator", self.coordinator, "must be host:port (e.g. 10.0.0.1:8476)")
        check(0 <= self.coordinator_port < 65536, name, "coordinator_port",
              self.coordinator_port, "must be a port in [1, 65535], or 0")
        check(self.local_devices >= 0, name, "local_devices", self.local_devices,
              "must be >= 0 (0: XLA_FLAGS as they are)")
        check(self.init_timeout_s > 0, name, "init_timeout_s", self.init_timeout_s,
              "must be > 0")
