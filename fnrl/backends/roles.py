"""Starting, watching, restarting and stopping the role processes of one job.

Each role is a child process with its own log file in the run directory, in its own
session (a SIGINT to the controller's terminal does not reach it; the controller stops
roles in order), and killed by the kernel if the controller dies (PR_SET_PDEATHSIG), so
a crashed controller never leaves roles behind. The trainer and the rollouts are
watched by the supervisor (fnrl.control.supervisor), which restarts them; `check`
raises a RoleError naming any other role that exited, with how it ended (the kernel's
out-of-memory killer named when the evidence says so) and the tail of its log.

Stopping: `Cluster.stop_on_signals()` makes SIGINT, SIGTERM and SIGHUP stop every role at
once, from the signal handler, and then raise `Stopped`. Stopping first matters: the
controller's threads block on roles (a trainer call, a server's start) and asyncio waits
for them before it unwinds, so a Ctrl-C during a vLLM start used to wait for the whole
start (59 s measured with the 2-layer model, minutes with a real one) and invited more
Ctrl-Cs that cut the stop itself short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fnrl.config import RelayConfig, RunConfig, load_json
from fnrl.config.distributed import split_host_port
from fnrl.policy.gpu_memory import GpuSplit
from fnrl.relay.client import RelayClient, RelayError
from fnrl.relay.launch import relay_argv, remove_segments, wait_relay_ready
from fnrl.relay.tier import RelayMember, RelayTier
from fnrl.serving.server import ServerSpec, launch_server, wait_ready
from fnrl.shell import auth, procs
from fnrl.shell.files import log_tail, write_atomic
from fnrl.shell.net import free_port, port_taken
from fnrl.shell.procs import reap_leftovers
from fnrl.shell.wire import NodeLost, RoleError


class Stopped(KeyboardInterrupt):
    """The job got a stop signal (SIGINT, SIGTERM or SIGHUP) and its roles are stopped.
    A KeyboardInterrupt, so asyncio and `except Exception` blocks let it through."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class RoleProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str


SUPERVISED = ("trainer", "rollout")   # restarted by the supervisor, not fatal here
EVAL_SERVER = "eval"   # the evaluation server: its lane stops when it dies, the job goes on
SERVER_GRACE_S = 3.0
"""SIGTERM to SIGKILL for a vLLM server (see `Cluster.stop`)."""
SAMPLE_S = 1.0
"""How often each live role's OOM evidence is refreshed (peak RSS, OOM-kill counts)."""


class LocalLauncher:
    """Starts every role as a child process of the controller, on this host (the
    `local` backend). fnrl.backends.ray_cluster.RayLauncher places them on Ray nodes
    behind the same methods."""

    home_relays = None   # rollout i pulls from relay i % n (fnrl.relay.tier)

    def __init__(self, gpu: GpuSplit | None = None):
        self.gpu = gpu   # the one GPU's split between trainer and servers (None: not shared)

    def relay_count(self, configured: int) -> int:
        """How many relays the job starts: `relay.num_relays` on one host."""
        return configured

    def node_of(self, role: str) -> str:
        return "local"

    def node_alive(self, role: str) -> bool:
        """Whether `role`'s node is still there: this host always is."""
        return True

    def node_id_of(self, role: str) -> str:
        return "local"

    def address(self, role: str) -> str:
        """A ZeroMQ address for a trainer or relay: loopback, a free port."""
        return f"tcp://127.0.0.1:{free_port()}"

    def place_server(self, role: str, spec: ServerSpec) -> ServerSpec:
        return spec

    def spawn(self, role: str, argv: list[str], log_path: Path, *,
              death_signal: int = signal.SIGKILL, relay: bool = False):
        return procs.spawn(argv, log_path, env=self.role_env(role), death_signal=death_signal)

    def role_env(self, role: str) -> dict[str, str]:
        """A role's environment: ours, and a trainer's memory fraction on a shared GPU."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.gpu is not None and role.startswith("trainer"):   # its standby too
            for name, value in self.gpu.trainer_env().items():
                if value is None:
                    env.pop(name, None)
                else:
                    env[name] = value
        return env

    def server_spec(self, role: str, spec: ServerSpec) -> ServerSpec:
        """`spec` with the GPU split's vLLM flags for server `role` (as it is without one)."""
        if self.gpu is None:
            return spec
        return dataclasses.replace(spec, extra_args=spec.extra_args + self.gpu.server_args(role))

    def launch_server(self, role: str, spec: ServerSpec, log_path: Path):
        return launch_server(self.server_spec(role, spec), log_path)

    def check_memory(self, plan) -> None:
        """Nothing more: the job's plan was checked against this host before it started."""

    def check(self) -> None:
        """Nothing to raise: this host is the controller's own."""

    def lost_nodes(self) -> dict[str, str]:
        return {}

    def remove_segments(self, relay: str, proc) -> None:
        if not procs.alive(proc.pid):
            remove_segments(relay, proc.pid)

    def close(self) -> None:
        pass


class Cluster:
    """The relay, the trainer and the vLLM servers of one run: on this host, or on the
    nodes a launcher places them on (`launcher`, default `LocalLauncher`)."""

    def __init__(self, run_dir: Path, launcher=None):
        self.run_dir = run_dir
        self.launcher = launcher or LocalLauncher()
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # A previous controller of this run that was SIGKILLed may have left some (a vLLM
        # engine process outlives its server when only the server had PDEATHSIG).
        reap_leftovers(run_dir / "roles.json")
        procs.remove_orphan_scratch()   # their servers' temporary files
        # What those left in shared memory (a relay stopped, or killed before it could
        # unlink its segments).
        for name, info in read_roles(run_dir / "roles.json").items():
            if (name.startswith("relay") and info.get("node", "local") == "local"
                    and not procs.alive(int(info["pid"]))):
                remove_segments(name, int(info["pid"]))
        # A fresh run secret per attempt, inherited by every role spawned from now on: a
        # message of an earlier attempt or another run fails its check (fnrl.shell.auth).
        auth.start_run()
        self.roles: list[RoleProcess] = []
        self._relays_started: list[tuple[str, object]] = []   # (name, proc): segment owners
        self._replaced: list = []   # processes of roles replaced after they died
        self.relay_tier: RelayTier | None = None
        self._trainer_argv: tuple[Path, Path, str] | None = None
        self._server_specs: dict[int, ServerSpec] = {}
        self._eval_spec: ServerSpec | None = None
        self._log_start: dict[str, int] = {}
        self._stopping = threading.Event()
        self.stop_signal: int | None = None   # the signal that stopped the job, if one did
        self._stopped: dict[str, RoleProcess] = {}   # by name, what stop() stopped
        self._sampler = threading.Thread(target=self._sample_roles, name="role-sampler",
                                         daemon=True)
        self._sampler.start()

    def _sample_roles(self) -> None:
        # A role the kernel kills for memory is told apart from one killed from outside
        # by the OOM-kill counts read last while it was alive (fnrl.shell.exits).
        while not self._stopping.wait(SAMPLE_S):
            for role in list(self.roles):
                procs.sample(role.proc)

    def exit_reason(self, name: str) -> str:
        """How role `name` ended, with the evidence: "exited with code 1", "was killed by
        the kernel's out-of-memory killer (...)", "was killed by SIGKILL from outside
        fnrl (...)", "was killed by fnrl with SIGKILL (code -9)"."""
        return procs.exit_reason(self.role(name).proc)

    def _add(self, role: RoleProcess) -> RoleProcess:
        """Registers a role (replacing one of the same name, whose leftovers go) and
        records every pid in roles.json (for operators and tests)."""
        for old in self.roles:
            if old.name == role.name:
                procs.release(old.proc)
                self._replaced.append(old.proc)   # released again at stop, if not gone yet
        self.roles = [r for r in self.roles if r.name != role.name] + [role]
        write_atomic(self.run_dir / "roles.json", json.dumps(
            {r.name: {"pid": r.proc.pid, "address": r.address, "log": str(r.log_path),
                      "node": self.launcher.node_of(r.name),
                      "node_id": self.launcher.node_id_of(r.name)}
             for r in self.roles}, indent=2))
        return role

    def _spawn(self, name: str, argv: list[str], address: str, **kw) -> RoleProcess:
        log_path = self.run_dir / "logs" / f"{name}.log"
        return RoleProcess(name, self.launcher.spawn(name, argv, log_path, **kw), log_path,
                           address)

    def start_relay(self, name: str = "relay0", cfg: RelayConfig | None = None) -> RoleProcess:
        address = self.launcher.address(name)
        # SIGTERM when the controller dies, even by SIGKILL: the relay unlinks its
        # shared-memory segments on the way out.
        role = self._spawn(name, relay_argv(address, name, cfg), address,
                           death_signal=signal.SIGTERM, relay=True)
        self._relays_started.append((name, role.proc))
        return self._add(role)

    def start_relays(self, cfg: RelayConfig, timeout_s: float = 60.0) -> RelayTier:
        """`cfg.num_relays` relays (one per simulated host) in a broadcast chain whose
        monitor splices out dead relays and re-elects a dead master. The tier's `addresses`
        (master first) go to the trainer; rollout i pulls from `addresses[i % n]`."""
        roles = [self.start_relay(f"relay{i}", cfg) for i in range(cfg.num_relays)]
        members = []
        for role in roles:
            try:
                ping = wait_relay_ready(role.address, role.proc, timeout_s)
            except RuntimeError as err:
                raise RoleError(f"{err}{log_tail(str(role.log_path))}") from err
            members.append(RelayMember(name=role.name, address=role.address,
                                       ucx_address=ping["ucx_address"], proc=role.proc))
        self.relay_tier = RelayTier(members, cfg, homes=self.launcher.home_relays)
        self.relay_tier.configure()
        self.relay_tier.start_monitor()
        return self.relay_tier

    def start_replacement_relay(self, name: str) -> RoleProcess:
        """A new relay process under the name of `name`, a relay that exited, on the
        same node (call it from the thread that lives as long as the job: the process
        dies with that thread, PR_SET_PDEATHSIG). Raises RoleError when the relay
        still runs, or its node is lost (no replacement then: its rollouts keep
        pulling from the survivors)."""
        old = self.role(name)
        if old.proc.poll() is None:
            raise RoleError(f"{name} still runs: nothing to replace")
        if not self.launcher.node_alive(name):
            raise NodeLost(f"{name}: its node {self.launcher.node_of(name)} is lost; "
                           "no replacement")
        self.launcher.remove_segments(name, old.proc)   # what the dead one left behind
        return self.start_relay(name, self.relay_tier.cfg)

    def join_relay(self, role: RoleProcess, timeout_s: float = 120.0) -> int | None:
        """Wait until the replacement `role` answers, then join it to the tier's chain
        (fnrl.relay.tier.RelayTier.join); the version it held when it began to serve.
        Blocks for seconds: run it off the event loop. Raises RoleError if it did not
        start, JoinFailed if it could not catch up."""
        try:
            ping = wait_relay_ready(role.address, role.proc, timeout_s)
        except RuntimeError as err:
            raise RoleError(f"{err}{log_tail(str(role.log_path))}") from err
        return self.relay_tier.join(
            RelayMember(name=role.name, address=role.address,
                        ucx_address=ping["ucx_address"], proc=role.proc), timeout_s)

    def wait_tier_holds(self, version: int, timeout_s: float) -> None:
        """Block until every relay in the chain serves `version` (the trainer's first, so
        each rollout finds it at its own relay). Asks in short waits, so a stop (or a
        relay that died) ends it at once rather than after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for address in self.relay_tier.addresses:
            with RelayClient(address, timeout_s=1.0) as relay:
                while True:
                    if self._stopping.is_set():
                        raise RoleError("the job is stopping")
                    try:
                        relay.wait_version(version, timeout_s=1.0)
                        break
                    except RelayError as err:
                        if time.monotonic() > deadline:
                            raise RoleError(f"relay {address} never received version "
                                            f"{version}: {err}") from err

    def stop_on_signals(self, signals=STOP_SIGNALS) -> Callable[[], None]:
        """From now on the first SIGINT, SIGTERM or SIGHUP stops every role at once (from
        the signal handler, in the main thread; threads blocked on a role then see it
        exit) and raises `Stopped`; signals while stopping are ignored, so a second
        Ctrl-C cannot cut the stop short. Returns the function that puts the previous
        handlers back and then raises `Stopped` if a signal stopped the cluster, even one
        whose exception was swallowed where it landed. Call it from the main thread."""
        def handler(signum, frame):
            if self._stopping.is_set():
                return
            # Kept as well as raised: a signal that lands in a weakref callback or a
            # finalizer has its exception swallowed there (seen: the roles stopped, the
            # job took their exits for failures and restarted); the job checks this.
            self.stop_signal = signum
            # os.write: print could re-enter a write the signal interrupted.
            os.write(2, f"fnrl: {signal.Signals(signum).name}: stopping every role\n".encode())
            self.stop()
            raise Stopped(signum)

        # A signal ignored already stays ignored (SIGHUP under nohup).
        previous = {s: signal.signal(s, handler) for s in signals
                    if signal.getsignal(s) is not signal.SIG_IGN}

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)
            if self.stop_signal is not None:   # even if the handler's Stopped was swallowed
                raise Stopped(self.stop_signal)
        return restore

    def role(self, name: str) -> RoleProcess:
        """The live role `name`, or the last of that name that `stop` stopped: tasks that
        outlive a stop (a stream asking whether its server exited) still find it."""
        for r in self.roles:
            if r.name == name:
                return r
        if name in self._stopped:
            return self._stopped[name]
        # KeyError, not StopIteration: raised inside a coroutine, StopIteration becomes a
        # RuntimeError that hides which role was asked for.
        raise KeyError(f"no role named {name!r}")

    def kill(self, name: str, *, sig: int = signal.SIGKILL, wait: bool = True) -> None:
        """Signal a role's process group: SIGKILL (a fault, injected or decided) or
        SIGSTOP (an injected hang)."""
        proc = self.role(name).proc
        procs.signal_group(proc, sig)
        if wait and sig == signal.SIGKILL:
            proc.wait()

    def restart_trainer(self, name: str = "trainer") -> RoleProcess:
        """A new trainer process with the first one's arguments, publishing to the relays
        alive now (master first); `name="trainer_standby"` starts a warm spare."""
        config_path, model_dir, relay = self._trainer_argv
        if self.relay_tier is not None:
            relay = ",".join(self.relay_tier.addresses)
        return self.start_trainer(config_path, model_dir, relay, name=name)

    def promote(self, name: str, as_name: str) -> RoleProcess:
        """The role `name` becomes `as_name` (a standby taking over a dead role's place)."""
        role = dataclasses.replace(self.role(name), name=as_name)
        self.roles = [r for r in self.roles if r.name != name]
        return self._add(role)

    def restart_server(self, rid: int) -> RoleProcess:
        """A new vLLM server for rollout `rid`, on a fresh port."""
        spec = dataclasses.replace(self._server_specs[rid], port=free_port())
        return self.start_server(rid, spec)

    def start_trainer(self, config_path: Path, model_dir: Path, relay: str, *,
                      name: str = "trainer") -> RoleProcess:
        self._trainer_argv = (config_path, model_dir, relay)
        address = self.launcher.address(name)
        argv = [sys.executable, "-m", "fnrl.trainer.role", "--config", str(config_path),
                "--model-dir", str(model_dir), "--run-dir", str(self.run_dir),
                "--address", address, "--relay", relay]
        trainer = load_json(RunConfig, config_path).trainer
        processes = trainer.distributed.num_processes
        if processes > 1:
            argv = trainer_group_argv(argv, processes, address,
                                      self.run_dir / "logs" / name,
                                      gpus_per_process=trainer.gpus_per_process)
        return self._add(self._spawn(name, argv, address))

    def _start_server(self, name: str, spec: ServerSpec) -> RoleProcess:
        spec = self.launcher.place_server(name, spec)
        log_path = self.run_dir / "logs" / f"{name}.log"
        # Where this start's output begins in the (appended) log: what port_taken reads.
        self._log_start[name] = log_path.stat().st_size if log_path.exists() else 0
        return self._add(RoleProcess(name, self.launcher.launch_server(name, spec, log_path),
                                     log_path, spec.base_url))

    def start_server(self, rid: int, spec: ServerSpec) -> RoleProcess:
        self._server_specs[rid] = spec
        return self._start_server(f"rollout{rid}", spec)

    def start_eval_server(self, spec: ServerSpec) -> RoleProcess:
        """The dedicated evaluation server (fnrl.control.eval_lane), named "eval"."""
        self._eval_spec = spec
        return self._start_server(EVAL_SERVER, spec)

    def wait_relay_ready(self, relay: RoleProcess, timeout_s: float = 60.0) -> None:
        try:
            wait_relay_ready(relay.address, relay.proc, timeout_s)
        except RuntimeError as err:
            raise RoleError(f"{err}{log_tail(str(relay.log_path))}") from err

    def wait_servers_ready(self, timeout_s: float, port_retries: int = 3) -> None:
        """Waits for every server (`wait_server_ready`)."""
        for name in [r.name for r in self.roles
                     if r.name.startswith("rollout") or r.name == EVAL_SERVER]:
            self.wait_server_ready(name, timeout_s, port_retries)

    def wait_server_ready(self, name: str, timeout_s: float, port_retries: int = 3) -> float:
        """Waits for server `name`; returns the seconds it took. One that exits before it
        is ready because its port was taken after `free_port` chose it starts again on a
        fresh port (its role's address changes), up to `port_retries` times; any other
        failure raises RoleError with its log."""
        t0 = time.monotonic()
        for attempt in range(port_retries + 1):
            role = self.role(name)
            try:
                wait_ready(role.address, role.proc, timeout_s)
                return time.monotonic() - t0
            except RuntimeError as err:
                if not (attempt < port_retries and role.proc.poll() is not None
                        and port_taken(role.log_path, self._log_start.get(name, 0))):
                    raise RoleError(f"{name}: {err}") from err
                print(f"fnrl: {name}: {role.address} was taken before the server bound "
                      "it; starting it again on a fresh port", flush=True)
                procs.stop(role.proc, 5.0)
                if name == EVAL_SERVER:
                    self.start_eval_server(dataclasses.replace(self._eval_spec,
                                                               port=free_port()))
                else:
                    self.restart_server(int(name.removeprefix("rollout")))

    def check(self) -> None:
        self.launcher.check()   # ClusterLost: the cluster under the roles is gone
        tier = self.relay_tier
        for role in self.roles:
            code = role.proc.poll()
            if role.name.startswith(SUPERVISED) or role.name == EVAL_SERVER:
                continue
            if code is not None and tier is not None and role.name in tier.members and any(
                    tier.members[n].proc is None or tier.members[n].proc.poll() is None
                    for n in tier.plan.order if n != role.name):
                continue  # the tier's monitor splices a dead relay out; survivors carry on
            if code is not None:
                raise RoleError(f"{role.name} {procs.exit_reason(role.proc)}"
                                f"{log_tail(str(role.log_path))}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every role, then SIGKILL what is left after the grace period. The
        relay tier stops its own relays (a stopped or killed one's shared-memory
        segments are unlinked too)."""
        self._stopping.set()
        self._stopped.update((r.name, r) for r in self.roles)
        if self.relay_tier is not None:
            self.relay_tier.stop(grace_s)
            # A replacement relay that had not joined yet is not the tier's: stopped here.
            self.roles = [r for r in self.roles if not self.relay_tier.owns(r.proc.pid)]
        # vLLM stops its engine at once on SIGTERM, then its HTTP server waits for open
        # connections (a stop from a signal handler finds the job's streams open).
        procs.stop_all([r.proc for r in self.roles],
                       [min(grace_s, SERVER_GRACE_S)
                        if r.name.startswith("rollout") or r.name == EVAL_SERVER else grace_s
                        for r in self.roles])
        self.roles.clear()
        for proc in self._replaced:   # a replaced role's group may have outlived the swap
            procs.release(proc)
        # A relay SIGKILLed after the grace period (or stopped before the tier existed)
        # could not unlink its segments.
        for name, proc in self._relays_started:
            self.launcher.remove_segments(name, proc)


def trainer_group_argv(argv: list[str], processes: int, address: str, prefix: Path, *,
                       gpus_per_process: int = 0) -> list[str]:
    """The trainer role as `processes` JAX processes (fnrl.trainer.group): one leader on
    the trainer's node starts them all, with process 0's coordinator at the host of the
    trainer's own `address` (the node's address; loopback on one host)."""
    host, _ = split_host_port(address.removeprefix("tcp://"))
    gpus = ["--gpus-per-process", str(gpus_per_process)] if gpus_per_process else []
    return [sys.executable, "-m", "fnrl.trainer.group", "--processes", str(processes),
            "--host", host, "--name-prefix", str(prefix), *gpus, "--", *argv]


def read_roles(path: Path) -> dict:
    """roles.json of a previous controller of the run ({} when there is none)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
