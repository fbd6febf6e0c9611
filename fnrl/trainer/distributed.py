"""How a trainer process joins the group of trainer processes on one global mesh.

Each of N processes calls `join` before its first JAX computation; `jax.distributed`
connects them through process 0's coordinator, after which `jax.devices()` lists every
process's devices and one jitted step runs SPMD over all of them (fnrl.sharding.mesh
builds the mesh over the global devices, `global_arrays` places host batches on it).

Where the group's shape comes from (`resolve_group`, pure over a mapping of environment
variables), field by field, first found wins:
  1. the config (`trainer.distributed.*`, so the command line);
  2. SLURM's srun variables: SLURM_NTASKS, SLURM_PROCID, and the coordinator on the
     first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST, SLURM_NODELIST);
  3. FNRL_NUM_PROCESSES, FNRL_PROCESS_ID, FNRL_COORDINATOR (a Kubernetes indexed Job or
     StatefulSet, a Ray actor, or by hand). FNRL_COORDINATOR also overrides the SLURM
     node list (an explicit address beats a derived one).
The environment is read only when the config asks for it (num_processes=0, or a
process_id / coordinator left unset with num_processes > 1): a single trainer started
inside a SLURM job never joins a group by accident.

On CPU the processes exchange data with gloo over TCP. The coordinator binds exactly the
address it is given (JAX's default is every interface), and when that address is
loopback gloo binds loopback too: nothing listens beyond 127.0.0.1 unless the group
spans hosts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, MutableMapping

from fnrl.config.cluster import LOOPBACK, is_loopback
from fnrl.config.distributed import DEFAULT_COORDINATOR_PORT, DistributedConfig, split_host_port

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessGroup:
    """A resolved group: this process's rank among `num_processes`, and where process 0
    listens."""
    num_processes: int
    process_id: int
    coordinator: str
    source: str      # "config", "slurm" or "env": where the ids came from (for logs)

    @property
    def coordinator_host(self) -> str:
        return split_host_port(self.coordinator)[0]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[003-010,012],cpu1" -> "gpu003"."""
    first = re.match(r"[^,\[]*(\[[^\]]*\])?[^,]*", nodelist.strip()).group(0)
    bracket = re.search(r"\[([^\]]*)\]", first)
    if bracket is None:
        host = first
    else:
        # The first item of the range list keeps its zero padding: [003-010] -> 003.
        start = bracket.group(1).split(",")[0].split("-")[0]
        host = first[:bracket.start()] + start + first[bracket.end():]
    if not host:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    return host


def _env_int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={environ[name]!r} is not an "
                         "integer") from None


def _from_env(environ: Mapping[str, str], slurm: bool, slurm_var: str, fnrl_var: str,
              what: str) -> tuple[int, str]:
    """(value, source) of one group figure: SLURM's variable inside a SLURM step, else
    fnrl's own; ValueError saying `what` and that neither is set."""
    if slurm:
        return _env_int(environ, slurm_var), "slurm"
    if fnrl_var in environ:
        return _env_int(environ, fnrl_var), "env"
    raise ValueError(f"{what} from {slurm_var} or {fnrl_var}; neither is set")


def resolve_group(cfg: DistributedConfig, environ: Mapping[str, str]) -> ProcessGroup | None:
    """The process group `cfg` and the environment describe; None for one process (the
    default: then nothing is read from the environment). Raises ValueError naming what
    is missing or inconsistent."""
    if cfg.num_processes == 1:
        return None
    slurm = "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ
    source = "config"
    num, rank = cfg.num_processes, cfg.process_id
    if num == 0:
        num, source = _from_env(environ, slurm, "SLURM_NTASKS", "FNRL_NUM_PROCESSES",
                                "trainer.distributed.num_processes=0 reads the group's size")
    if rank == -1:
        rank, source = _from_env(environ, slurm, "SLURM_PROCID", "FNRL_PROCESS_ID",
                                 "trainer.distributed.process_id=-1 reads this process's rank")
    if num < 1 or not 0 <= rank < num:
        raise ValueError(f"process_id={rank} is not in [0, num_processes={num}) "
                         f"(from {source})")
    if num == 1:
        return None
    return ProcessGroup(num_processes=num, process_id=rank,
                        coordinator=_coordinator(cfg, environ, slurm), source=source)


def _coordinator(cfg: DistributedConfig, environ: Mapping[str, str], slurm: bool) -> str:
    if cfg.coordinator:
        return cfg.coordinator
    port = cfg.coordinator_port or DEFAULT_COORDINATOR_PORT
    if environ.get("FNRL_COORDINATOR"):
        address = environ["FNRL_COORDINATOR"]
        if split_host_port(address) is None:
            raise ValueError(f"FNRL_COORDINATOR={address!r} is not host:port")
        return address
    nodelist = next((environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                          "SLURM_NODELIST") if environ.get(k)), "")
    if slurm and nodelist:
        if not cfg.coordinator_port and environ.get("SLURM_JOB_ID", "").isdigit():
            # As JAX's own SLURM detection: the job id picks one of the top 4,096 ports.
            port = 61440 + int(environ["SLURM_JOB_ID"]) % 4096
        return f"{first_slurm_host(nodelist)}:{port}"
    return f"{LOOPBACK}:{port}"


def set_local_devices(count: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Makes XLA's CPU backend expose `count` devices (replacing any count in XLA_FLAGS).
    Call before JAX starts its backend; 0 leaves the flags as they are."""
    if count <= 0:
        return
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\d+", "", environ.get("XLA_FLAGS", "")).split()
    environ["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={count}"])


def _gloo_on(host: str) -> None:
    """Makes the CPU backend's gloo collectives listen on `host`. JAX's public switch
    (jax_cpu_collectives_implementation) lets gloo pick the address the machine's host
    name resolves to, which is a real interface on most machines: a group on one host
    must stay on loopback."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def make_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=host)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_client, priority=0, fail_quietly=False)


def join(cfg: DistributedConfig, environ: MutableMapping[str, str] = os.environ
         ) -> ProcessGroup | None:
    """Joins this process to its trainer group (None: one process, nothing done).

    Must run before the first JAX computation: the CPU device count and the collectives
    are fixed when JAX starts its backend. Blocks until every process has joined or
    `cfg.init_timeout_s` passes.
    """
    set_local_devices(cfg.local_devices, environ)
    group = resolve_group(cfg, environ)
    if group is None:
        return None
    import jax

    # CPU collectives (the CPU backend only: accelerators bring their own, NCCL on GPUs).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if is_loopback(group.coordinator_host):
        _gloo_on(LOOPBACK)
    # The coordinator binds the one address it is reached at, not every interface. JAX's
    # own cluster detection is off: under SLURM it would also narrow each process to the
    # one GPU of its SLURM_LOCALID; a process sees the devices its launcher gives it.
    jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id,
                               initialization_timeout=cfg.init_timeout_s,
                               coordinator_bind_address=group.coordinator,
                               cluster_detection_method="deactivate")
    return group


def leave() -> None:
    """Leaves the group (every process calls it, so none exits while others still need
    it; the coordinator's process waits for the rest)."""
    import jax

    jax.distributed.shutdown()
