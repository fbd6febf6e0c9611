"""The Ray backend: the job's roles placed on the nodes of a Ray cluster
(`--cluster.backend ray`).

Ray starts, places and watches; fnrl's roles stay its own processes. On every node the
job uses, one `NodeHost` actor (pinned to that node, no CPU reserved) starts the role
processes there with fnrl.shell.procs, exactly as the local backend does on one host:
each role in its own session, killed with the host that started it (PR_SET_PDEATHSIG),
so a crashed or removed host leaves nothing behind, and a crashed server or relay never
takes another role down. The controller holds `HostedProcess` handles and reaches the
roles by address, as it does locally: ZeroMQ for the trainer and relays, HTTP for vLLM.

Placement is the pure `fnrl.policy.placement.place_roles` over the cluster's alive
nodes, named by the `cluster.node_label` label (`ray start --labels fnrl-node=a`): the
trainer on its node, rollouts on the others, one relay per node used, each rollout
pulling from its own node's relay. Roles bind the node's address as Ray reports it
(127.0.0.1 in a one-machine test cluster), so a cluster that spans machines binds real
interfaces, with the run's secret and API key required there (fnrl.shell.auth,
fnrl.serving.http_auth). The run directory must be on a file system every node sees
(logs, checkpoints, the batch log); docs/multinode.md says how.

GPUs: the placement takes each node's GPU count from Ray (`ray.nodes()` resources) and
gives each role GPU indices on its node (trainer: processes x `gpus_per_process`; each
vLLM server: its tensor-parallel size). Each node's host actor reserves its roles' GPUs
from Ray (`num_gpus` = their sum), so Ray's accounting holds them and sets the host's
CUDA_VISIBLE_DEVICES to the GPUs it granted; the host hands each role its disjoint slice
of those as the role's CUDA_VISIBLE_DEVICES (`visible_devices`). Bookkeeping on the one
host, not a placement group or actor per role: the roles stay the host's children
(killed with it, restarted and moved by the controller's supervisor, never by Ray), and
a role restarted on its node reuses its GPUs without asking Ray again. A CPU cluster
(no GPU anywhere) reserves nothing and sets no variable: runs as before.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fnrl.config import ClusterConfig
from fnrl.policy.placement import Placement, place_roles
from fnrl.relay.launch import remove_segments
from fnrl.backends.memory import MemoryPlan, check_plan_per_machine
from fnrl.serving.server import ServerSpec, launch_server, read_host_memory
from fnrl.shell import auth, procs
from fnrl.shell.hosted import HostedProcess
from fnrl.shell.net import connect_error, free_port
from fnrl.shell.wire import ClusterLost, NodeLost

# Ray ends a driver that cannot reach its cluster's head (the GCS) for
# gcs_rpc_server_reconnect_timeout_s, 60 s by default ("Failed to connect to GCS ... The
# program will terminate"): the job notices first, and stops with its summary written.
GCS_LOST_S = 10.0


@ray.remote(num_cpus=0, max_concurrency=16)
class NodeHost:
    """On one node: starts role processes there and answers for them by pid."""

    def __init__(self, node: str, file_mask: int = 0o077):
        self.node = node
        # The roles it starts write the run directory under the controller's umask.
        os.umask(file_mask)
        self._procs: dict[int, object] = {}
        self._relays: dict[int, str] = {}
        # PR_SET_PDEATHSIG fires when the *thread* that forked a child ends: every spawn
        # runs on this one thread, which lives as long as the actor.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawn")

    def ip(self) -> str:
        return ray.util.get_node_ip_address()

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray granted this host (its CUDA_VISIBLE_DEVICES; none without GPUs)."""
        if not ray.get_gpu_ids():
            return []
        return [i for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i]

    def node_id(self) -> str:
        """The Ray node this host (and every process it starts) runs on."""
        return ray.get_runtime_context().get_node_id()

    def available_bytes(self) -> int:
        """MemAvailable of this node's machine now."""
        return read_host_memory().available_bytes

    def free_port(self) -> int:
        return free_port()

    def spawn(self, argv: list[str], log_path: str, extra_env: dict, death_signal: int,
              relay: str | None = None) -> int:
        """Starts `argv` in this node's environment plus `extra_env` (the run's secret:
        the controller's variables are its host's, not this node's)."""
        env = dict(os.environ, **extra_env)
        proc = self._spawner.submit(procs.spawn, argv, log_path, env=env,
                                    death_signal=death_signal).result()
        self._procs[proc.pid] = proc
        if relay is not None:
            self._relays[proc.pid] = relay
        return proc.pid

    def launch_server(self, spec: ServerSpec, log_path: str, secret: str) -> int:
        """fnrl.serving.server.launch_server on this node (its memory check included),
        under the run's `secret` (the server's environment is built from this one's)."""
        os.environ[auth.ENV_VAR] = secret
        proc = self._spawner.submit(launch_server, spec, log_path).result()
        self._procs[proc.pid] = proc
        return proc.pid

    def status(self, pids: Sequence[int]) -> dict[int, int | None]:
        """Every process's exit code (None: it runs), in one answer: what the
        controller's watcher asks each WATCH_S."""
        return {pid: self._procs[pid].poll() for pid in pids if pid in self._procs}

    def signal_group(self, pid: int, sig: int) -> bool:
        return procs.signal_group(self._procs[pid], sig)

    def stop_all(self, pids: Sequence[int], graces: Sequence[float]) -> None:
        procs.stop_all([self._procs[p] for p in pids], list(graces))
        for pid in pids:
            self.remove_segments(pid)

    def exit_reason(self, pid: int) -> str:
        return procs.exit_reason(self._procs[pid])

    def sample(self, pid: int) -> None:
        procs.sample(self._procs[pid])

    def remove_segments(self, pid: int) -> int:
        """A dead relay's shared-memory segments on this node (0 for other roles)."""
        name = self._relays.get(pid)
        if name is None or self._procs[pid].poll() is None:
            return 0
        return remove_segments(name, pid)

    def stop_everything(self, grace_s: float) -> None:
        """Stops every process this host started that still runs (the job's last word)."""
        live = [p for p in self._procs.values() if p.poll() is None]
        procs.stop_all(live, grace_s)
        for pid in list(self._relays):
            self.remove_segments(pid)


class _Host:
    """The controller's view of one NodeHost (fnrl.shell.hosted.ProcessHost), which
    never holds the controller up on a node. A watcher thread asks the host for the state
    of every process it started each WATCH_S; `poll` reads the last answer. A host that
    has not answered for `hang_s` (hung: its actor stopped, its machine frozen or cut
    off), or whose actor died, or that failed a call in any other way Ray can fail it,
    is lost once and for good, the reason kept in `lost`: its processes poll as killed,
    `exit_reason` names the node and the reason, and it is killed through Ray (the
    node's raylet, when it still runs, kills the actor, and every role it started dies
    with it by PR_SET_PDEATHSIG; a host that wakes up later finds nothing to run).

    A call (a start, a stop) waits at most `timeout_s` (never more than `hang_s`), then
    the host is lost the same way; signals wait 2 s at most and OOM samples not at all."""

    WATCH_S = 0.5
    SIGNAL_WAIT_S = 2.0

    def __init__(self, actor, node: str, timeout_s: float, hang_s: float = 30.0):
        self.actor, self.node = actor, node
        self.timeout_s, self.hang_s = min(timeout_s, hang_s), hang_s
        self.lost: str | None = None
        self._codes: dict[int, int | None] = {}
        self._answered = time.monotonic()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sampling = None
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"fnrl-host-{node}")
        self._watcher.start()

    @property
    def dead(self) -> bool:
        return self.lost is not None

    def alive(self) -> bool:
        return self.lost is None

    def lose(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
        try:
            ray.kill(self.actor, no_restart=True)   # asynchronous: nothing waits on it
        except Exception:   # noqa: BLE001 - already gone, or Ray itself is
            pass

    def _lose_on(self, err: BaseException, call: str = "") -> None:
        """Loses the host for `err`, raised by Ray for `call` ("": the watcher's)."""
        if isinstance(err, ray.exceptions.GetTimeoutError):
            self.lose(f"its Ray host did not answer {call + ' ' if call else ''}for "
                      f"{self.timeout_s if call else self.hang_s:g} s: hung")
        elif isinstance(err, ray.exceptions.RayActorError):
            self.lose("its Ray host actor died")
        else:
            first = str(err).splitlines()[0][:200] if str(err) else ""
            self.lose(f"its Ray host failed{' ' + call if call else ''}: "
                      f"{type(err).__name__}: {first}")

    def _watch(self) -> None:
        try:
            self._watch_until_lost()
        except Exception as err:   # noqa: BLE001 - Ray shut down under it, or worse
            if not self._closed.is_set():
                self.lose(f"its watcher failed: {type(err).__name__}: {err}")

    def _watch_until_lost(self) -> None:
        while not self._closed.is_set() and self.lost is None:
            with self._lock:
                pids = list(self._codes)
            ref = self.actor.status.remote(pids)
            ready: list = []
            while not ready and not self._closed.is_set():
                left = self._answered + self.hang_s - time.monotonic()
                if left <= 0:
                    self._lose_on(ray.exceptions.GetTimeoutError())
                    return
                ready, _ = ray.wait([ref], timeout=min(left, self.WATCH_S))
            if self._closed.is_set():
                return
            try:
                codes = ray.get(ref)
            except ray.exceptions.RayError as err:
                self._lose_on(err)
                return
            with self._lock:
                self._answered = time.monotonic()
                self._codes.update(codes)
            self._closed.wait(self.WATCH_S)

    def watch(self, pid: int) -> int:
        with self._lock:
            self._codes.setdefault(pid, None)
        return pid

    def call(self, method: str, *args, timeout_s: float | None = None):
        """`method` of the host, answered within `timeout_s` (default `timeout_s`), or
        NodeLost with the node and the reason (the host is lost from then on). An
        exception the method itself raised is raised as it is."""
        if self.lost is None:
            try:
                return ray.get(getattr(self.actor, method).remote(*args),
                               timeout=timeout_s or self.timeout_s)
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayError as err:
                self._lose_on(err, method)
        raise NodeLost(f"node {self.node} is lost: {self.lost}")

    def poll(self, pid: int) -> int | None:
        if self.lost is not None:
            return -signal.SIGKILL
        with self._lock:
            return self._codes.setdefault(pid, None)

    def signal_group(self, pid: int, sig: int) -> bool:
        if self.lost is not None:
            return False
        ref = self.actor.signal_group.remote(pid, sig)
        try:   # a hung host gets it when it wakes; its watcher says whether it is lost
            return ray.get(ref, timeout=self.SIGNAL_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            return True
        except ray.exceptions.RayError as err:
            self._lose_on(err, "a signal")
            return False

    def stop_all(self, pids: Sequence[int], graces: Sequence[float]) -> None:
        try:
            self.call("stop_all", list(pids), list(graces), timeout_s=2 * max(graces) + 30)
        except NodeLost:
            pass   # killed through Ray with its host

    def exit_reason(self, pid: int) -> str:
        if self.lost is None:
            try:
                return self.call("exit_reason", pid)
            except NodeLost:
                pass
        return f"was lost with its node ({self.lost})"

    def sample(self, pid: int) -> None:
        """Asks the host to sample `pid`'s OOM evidence; the answer is not awaited (and
        one sample at a time is in flight)."""
        if self.lost is None and (self._sampling is None
                                  or ray.wait([self._sampling], timeout=0)[0]):
            self._sampling = self.actor.sample.remote(pid)

    def close(self) -> None:
        self._closed.set()
        self._watcher.join(timeout=2 * self.WATCH_S)


def recorded_address_file() -> Path:
    """Where `ray start` records the address of the cluster it started on this machine
    (what Ray itself reads for the address "auto")."""
    from ray._common.utils import get_ray_address_file   # Ray's own path (a private module)

    return Path(get_ray_address_file(None))


def find_address(cfg: ClusterConfig) -> tuple[str, str]:
    """The Ray cluster's address and where it came from (for messages): the flag, the
    RAY_ADDRESS variable, or the file the last `ray start` here wrote. ValueError when
    there is none."""
    if cfg.ray_address and cfg.ray_address != "auto":
        return cfg.ray_address, "--cluster.ray-address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "the RAY_ADDRESS variable"
    path = recorded_address_file()
    try:
        recorded = path.read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded, f"{path}, which the last `ray start` on this machine wrote"
    raise ValueError("cluster.backend='ray' found no Ray cluster to join: start one (ray start "
                     "--head) and give its address with --cluster.ray-address HOST:PORT (or "
                     "the RAY_ADDRESS variable)")


def _host_port(address: str, where: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the Ray address {address!r} (from {where}) is not HOST:PORT")
    return host, int(port)


def reachable_address(cfg: ClusterConfig) -> str:
    """`find_address`'s address once its head answers (a TCP connection to its port),
    within `cfg.connect_timeout_s`; else ValueError naming the address, where it came
    from and what to do. Each try is a short connect, so Ctrl-C and SIGTERM act at once
    (ray.init would retry a dead address for minutes and hold the signals off)."""
    address, where = find_address(cfg)
    host, port = _host_port(address, where)
    deadline = time.monotonic() + cfg.connect_timeout_s
    tries = 0
    while (err := connect_error(host, port, min(2.0, cfg.connect_timeout_s))) is not None:
        if not tries:
            print(f"fnrl: waiting for the Ray cluster at {address} (from {where}) to answer, "
                  f"up to {cfg.connect_timeout_s:g} s: {err}", flush=True)
        tries += 1
        if time.monotonic() >= deadline:
            stale = (f"; `ray stop` (or removing {recorded_address_file()}) forgets it"
                     if where.startswith(str(recorded_address_file())) else "")
            raise ValueError(
                f"no Ray cluster answers at {address} (from {where}) after "
                f"{cfg.connect_timeout_s:g} s: {err}. If that cluster is gone, the address is "
                f"stale: start a cluster (ray start --head) or name a live one with "
                f"--cluster.ray-address HOST:PORT{stale}")
        time.sleep(0.5)
    return address


def _base(role: str) -> str:
    """A role's place in the plan: a standby trainer goes where the trainer goes."""
    return "trainer" if role.startswith("trainer") else role


def name_nodes(ray_nodes: Sequence[dict], label: str) -> dict[str, tuple[str, int]]:
    """{node name: (Ray node id, GPU count)} of the alive nodes of `ray.nodes()`, named
    by `label` (else the id's first 8 characters), in name order: Ray lists nodes in no
    fixed order, and the placement must not change from one start to the next."""
    out = {}
    for node in ray_nodes:
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        gpus = int((node.get("Resources") or {}).get("GPU", 0))
        out[(node.get("Labels") or {}).get(label) or node_id[:8]] = (node_id, gpus)
    return dict(sorted(out.items()))


def cluster_nodes(label: str) -> dict[str, str]:
    """{node name: Ray node id} of the cluster's alive nodes (`name_nodes`)."""
    return {name: node_id for name, (node_id, _) in name_nodes(ray.nodes(), label).items()}


def visible_devices(host_gpus: Sequence[str], indices: Sequence[int]) -> str:
    """A role's CUDA_VISIBLE_DEVICES: its planned GPU indices into the ids Ray granted
    its node's host ("" for none)."""
    if indices and max(indices) >= len(host_gpus):
        raise RuntimeError(f"GPU indices {tuple(indices)} planned, but the node's host "
                           f"was granted {len(host_gpus)}: {list(host_gpus)}")
    return ",".join(host_gpus[i] for i in indices)


class RayLauncher:
    """Places and starts the roles of one job on a Ray cluster (the `ray` backend).
    The same methods as fnrl.backends.roles.LocalLauncher."""

    def __init__(self, cfg: ClusterConfig, num_rollouts: int, *, with_eval: bool,
                 gpus_per_process: int = 0, trainer_processes: int = 1,
                 tensor_parallel_size: int = 1, call_timeout_s: float = 120.0,
                 node_timeout_s: float = 30.0):
        ray.init(address=reachable_address(cfg), namespace=f"fnrl-{os.getpid()}",
                 log_to_driver=False, configure_logging=False)
        self.cluster_lost: str | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._watch_head, daemon=True, name="fnrl-ray-head",
                         args=(ray.get_runtime_context().gcs_address,)).start()
        named = name_nodes(ray.nodes(), cfg.node_label)
        nodes = {name: node_id for name, (node_id, _) in named.items()}
        self.placement: Placement = place_roles(
            tuple(nodes), num_rollouts, trainer_node=cfg.trainer_node, with_eval=with_eval,
            node_gpus={name: gpus for name, (_, gpus) in named.items()},
            trainer_gpus=gpus_per_process * max(trainer_processes, 1),
            server_gpus=tensor_parallel_size)
        used = dict.fromkeys((self.placement.trainer, *self.placement.rollouts,
                              *((self.placement.eval,) if self.placement.eval else ())))
        self._actors = {
            name: NodeHost.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nodes[name], soft=False), name=f"fnrl-host-{name}",
                num_gpus=self.placement.gpus_on(name)).remote(name, cfg.file_mask)
            for name in used}
        self.hosts = {name: _Host(a, name, call_timeout_s, node_timeout_s)
                      for name, a in self._actors.items()}
        self.ips = {name: host.call("ip") for name, host in self.hosts.items()}
        self.node_ids = {name: host.call("node_id") for name, host in self.hosts.items()}
        self.gpu_ids = {name: host.call("gpu_ids") for name, host in self.hosts.items()}
        misplaced = {n: i for n, i in self.node_ids.items() if i != nodes[n]}
        if misplaced:   # NodeAffinity with soft=False should make this impossible
            raise RuntimeError(f"node hosts started on the wrong Ray nodes: {misplaced}")
        self.home_relays = {rid: self.placement.home_relay(rid)
                            for rid in range(num_rollouts)}
        self._moved: dict[str, str] = {}       # role -> node, after its node was lost
        self._started: set[str] = set()

    def _watch_head(self, gcs_address: str) -> None:
        """Sets `cluster_lost` once the cluster's head (its GCS) has refused or not
        answered connections for GCS_LOST_S."""
        host, port = _host_port(gcs_address, "Ray")
        answered = time.monotonic()
        while not self._closed.wait(1.0):
            err = connect_error(host, port, timeout_s=2.0)
            if err is None:
                answered = time.monotonic()
            elif time.monotonic() - answered >= GCS_LOST_S:
                self.cluster_lost = (f"the Ray cluster's head (its GCS at {gcs_address}) has "
                                     f"not answered for {GCS_LOST_S:g} s: {err}")
                return

    def check(self) -> None:
        """Raises ClusterLost once the cluster's head is gone."""
        if self.cluster_lost is not None:
            raise ClusterLost(self.cluster_lost)

    def lost_nodes(self) -> dict[str, str]:
        """{node: why it was lost} of the job's nodes lost so far."""
        return {name: host.lost for name, host in self.hosts.items() if host.lost}

    def node_of(self, role: str) -> str:
        return self._moved.get(_base(role)) or self.placement.node_of(role)

    def node_alive(self, role: str) -> bool:
        """Whether the node `role` runs on still answers. A relay is replaced only there:
        one relay per node, beside the rollouts that pull from it; a lost node's relay
        is not started elsewhere (its rollouts, moved to survivors, pull from theirs)."""
        return self.hosts[self.node_of(role)].alive()

    def node_id_of(self, role: str) -> str:
        """The Ray node id the role's host reported (recorded in roles.json)."""
        return self.node_ids[self.node_of(role)]

    def relay_count(self, configured: int) -> int:
        """One relay per node the job uses, whatever `relay.num_relays` says."""
        return len(self.placement.relays)

    def _host(self, role: str) -> _Host:
        """The host that starts `role`: its planned node's, or, once that node is lost,
        a survivor's (the role moves for good; roles.json records where)."""
        node = self.node_of(role)
        if self.hosts[node].alive():
            return self.hosts[node]
        survivors = [n for n, h in self.hosts.items() if h.alive()]
        if not survivors:
            raise RuntimeError(f"{role}: every node of the job is lost")
        if self.placement.gpus.get(_base(role)):
            raise RuntimeError(
                f"{role} needs {len(self.placement.gpus[_base(role)])} GPUs and its node "
                f"{node} is lost: the other nodes' hosts reserved only their own roles' GPUs")
        # Generation roles prefer nodes other than the trainer's, the least loaded first.
        load = {n: sum(self.node_of(r) == n for r in self._started) for n in survivors}
        away = [n for n in survivors if n != self.node_of("trainer")] or survivors
        new = min(away if not role.startswith("trainer") else survivors,
                  key=lambda n: (load[n], survivors.index(n)))
        self._moved[_base(role)] = new
        if role.startswith("rollout") and new in self.placement.relays:
            # Pull from the relay beside it now (fnrl.relay.tier reads this mapping live).
            self.home_relays[int(role[len("rollout"):])] = self.placement.relays.index(new)
        return self.hosts[new]

    def address(self, role: str) -> str:
        host = self._host(role)
        return f"tcp://{self.ips[host.node]}:{host.call('free_port')}"

    def visible_devices(self, role: str) -> str:
        """The role's CUDA_VISIBLE_DEVICES on its node ("": it was planned no GPU)."""
        return visible_devices(self.gpu_ids[self.node_of(role)],
                               self.placement.gpus.get(_base(role), ()))

    def place_server(self, role: str, spec: ServerSpec) -> ServerSpec:
        host = self._host(role)   # moves the role first if its node is lost
        return dataclasses.replace(spec, host=self.ips[host.node], port=host.call("free_port"),
                                   visible_devices=self.visible_devices(role))

    def spawn(self, role: str, argv: list[str], log_path: Path, *,
              death_signal: int = signal.SIGKILL, relay: bool = False) -> HostedProcess:
        host = self._host(role)
        extra = {"PYTHONUNBUFFERED": "1", auth.ENV_VAR: auth.with_secret(None)[auth.ENV_VAR]}
        if devices := self.visible_devices(role):   # the trainer's (a relay needs none)
            extra["CUDA_VISIBLE_DEVICES"] = devices
        pid = host.watch(host.call("spawn", argv, str(log_path), extra, int(death_signal),
                                   role if relay else None))
        self._started.add(role)
        return HostedProcess(host, pid, log_path, host.node)

    def launch_server(self, role: str, spec: ServerSpec, log_path: Path) -> HostedProcess:
        host = self._host(role)
        secret = auth.with_secret(None)[auth.ENV_VAR]
        self._started.add(role)
        pid = host.watch(host.call("launch_server", spec, str(log_path), secret))
        return HostedProcess(host, pid, log_path, host.node)

    def check_memory(self, plan: MemoryPlan) -> None:
        """Each machine's planned roles against its available memory, before any role
        starts. Nodes that report one address share a machine (a test cluster's logical
        nodes), so their roles add up; the controller runs outside the placement."""
        role_of = {"standby": "trainer_standby", "controller": None}
        machine_of = {}
        for r in plan.roles:
            role = role_of.get(r.role, r.role.replace("server", "rollout", 1))
            machine_of[r.role] = None if role is None else self.ips[self.node_of(role)]
        available = {}
        for node, host in self.hosts.items():
            available.setdefault(self.ips[node], host.call("available_bytes"))
        check_plan_per_machine(plan, machine_of, available)

    def remove_segments(self, relay: str, proc) -> None:
        try:   # a lost node's segments went with it, or go when its host is killed
            proc.host.call("remove_segments", proc.pid)
        except NodeLost:
            pass

    def close(self, grace_s: float = 10.0) -> None:
        """Stops what the hosts still run, removes the hosts, leaves the cluster (which
        keeps running: it is not the job's). Hosts are reached directly, so this works
        with the cluster's head gone too."""
        self._closed.set()
        for host in self.hosts.values():
            try:
                host.call("stop_everything", grace_s, timeout_s=3 * grace_s + 30)
            except NodeLost:
                pass
            host.close()
        if self.cluster_lost is None:   # (a kill goes through the head)
            for actor in self._actors.values():
                ray.kill(actor)
        ray.shutdown()
