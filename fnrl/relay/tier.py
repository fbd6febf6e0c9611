"""The relay tier's controller: starts relays, orders the chain, repairs it.

It observes (pings every relay: alive? which version?), decides with the pure functions
of `fnrl.relay.chain`, and acts by sending each relay its place in the chain. A monitor
thread repeats this every `heartbeat_s`, so a dead relay is spliced out and a dead
master replaced without anyone asking. Every repair is recorded (`events`), and `stop`
ends every relay the tier knew, stopped (SIGSTOP) or spliced-out ones included.

A replacement relay (started by the job's controller under a dead relay's name) `join`s
the chain at its tail and serves pulls once it holds the newest version.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from fnrl.relay import chain as chain_policy
from fnrl.relay.client import RelayClient, RelayError
from fnrl.config import RelayConfig
from fnrl.relay.launch import launch_relay, stop_relay, wait_relay_ready
from fnrl.shell import procs
from fnrl.shell.hosted import HostedProcess
from fnrl.shell.net import free_port

log = logging.getLogger("fnrl.relay")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayMember:
    """One relay process as the controller knows it."""

    name: str
    address: str
    ucx_address: str
    proc: subprocess.Popen | None = None


class JoinFailed(RuntimeError):
    """A replacement relay died, or did not catch up in time, before it could serve."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainRepair:
    """One relay spliced out of the chain by the tier (with the master re-elected if it
    was the master). Times are epoch seconds; durations come from the monotonic clock."""

    relay: str
    cause: str
    """"exited" (killed or crashed), "stopped" (SIGSTOPped) or "hung" (alive, silent)."""
    detail: str
    was_master: bool
    master: str | None
    """The master after the repair (None when no relay is left)."""
    epoch: int
    failed_at: float
    """When the tier last saw it serving (its last answered ping)."""
    detected_at: float
    repaired_at: float
    """When the survivors had been sent their new places."""
    detection_s: float
    repair_s: float

    @property
    def down_s(self) -> float:
        """Seconds from the last answer of the relay to the repaired chain."""
        return self.detection_s + self.repair_s


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` ("T": stopped), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class RelayTier:
    """The relays of one job and their broadcast chain."""

    def __init__(self, members: list[RelayMember], cfg: RelayConfig,
                 homes: Mapping[int, int] | None = None):
        """`homes`: rollout index -> index (launch order) of the relay it pulls from, the
        one on its node (fnrl.policy.placement), read live (a rollout moved to another
        node pulls from that node's relay); None: relay `index % n`."""
        self.cfg = cfg
        self.homes = homes
        self.members = {m.name: m for m in members}
        self.removed: list[str] = []
        self.plan = chain_policy.ChainPlan(
            order=chain_policy.plan_chain([m.name for m in members], None), epoch=0)
        self._misses = {m.name: 0 for m in members}
        # Last answered ping (wall, monotonic): a repair's start as the tier saw it.
        now = (time.time(), time.monotonic())
        self._seen = {m.name: now for m in members}
        self._pids = {m.name: m.proc.pid for m in members if m.proc is not None}
        self._events: tuple[ChainRepair, ...] = ()  # replaced whole: read without the lock
        # Every relay process ever handed to the tier: `stop` ends them all, spliced or not.
        self._owned = {m.proc.pid: m for m in members if m.proc is not None}
        self.configured_epoch = 0
        # Joined the chain, still catching up: forwarded to, not yet pulled from.
        self._catching_up: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    @classmethod
    def launch(cls, cfg: RelayConfig, log_dir: str | os.PathLike, *, prefix: str = "relay",
               start_timeout_s: float = 60.0) -> RelayTier:
        """Start `cfg.num_relays` relay processes named `<prefix>0..`, chain them, and return
        the tier. Relays that were started are stopped again if any fails to come up."""
        def start(name: str) -> tuple[str, str, subprocess.Popen]:
            address = f"tcp://127.0.0.1:{free_port()}"
            return name, address, launch_relay(address, name, Path(log_dir) / f"{name}.log", cfg)

        procs = []
        try:
            procs += [start(f"{prefix}{i}") for i in range(cfg.num_relays)]
            members = []
            for i in range(len(procs)):
                for attempt in range(3):
                    name, address, proc = procs[i]
                    try:
                        ping = wait_relay_ready(address, proc, start_timeout_s)
                        break
                    except RuntimeError:
                        # Its port was taken between free_port and its bind (other jobs
                        # share the host): it exits, and another port is tried.
                        if proc.poll() is None or attempt == 2:
                            raise
                        procs[i] = start(name)
                members.append(RelayMember(name=name, address=address, proc=proc,
                                           ucx_address=ping["ucx_address"]))
        except BaseException:
            for name, _, proc in procs:
                stop_relay(proc, name)
            raise
        tier = cls(members, cfg)
        tier.configure()
        return tier

    def start_replacement(self, name: str, log_dir: str | os.PathLike, *,
                          start_timeout_s: float = 60.0) -> RelayMember:
        """Start a relay process called `name` on this host (its log appended to
        `<log_dir>/<name>.log`) and return it once it answers, ready to `join`; another
        port is tried if its port was taken before it could bind."""
        for attempt in range(3):
            address = f"tcp://127.0.0.1:{free_port()}"
            proc = launch_relay(address, name, Path(log_dir) / f"{name}.log", self.cfg)
            try:
                ping = wait_relay_ready(address, proc, start_timeout_s)
                return RelayMember(name=name, address=address, proc=proc,
                                   ucx_address=ping["ucx_address"])
            except BaseException:
                port_taken = proc.poll() is not None   # it exits when it cannot bind
                stop_relay(proc, name)
                if not port_taken or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @property
    def master(self) -> RelayMember:
        return self.members[self.plan.master]

    @property
    def addresses(self) -> list[str]:
        """Control addresses in chain order, the master's first."""
        return [self.members[n].address for n in self.plan.order]

    def local_address(self, index: int) -> str:
        """Control address of the relay a rollout with this index pulls from: relay
        `index % n` in launch order (its host's), or, once that one has been spliced out,
        a survivor's (spread over them by index, so one dead relay moves its rollouts
        to different neighbours). A replacement keeps the launch index of the relay it
        replaces, so its rollouts come back to it once it has caught up (`join`)."""
        plan = self.plan  # replaced whole by the monitor thread: read it once
        serving = [n for n in plan.order if n not in self._catching_up]
        launched = list(self.members)
        home = launched[self.homes[index] if self.homes and index in self.homes
                        else index % len(launched)]
        if home in serving:
            return self.members[home].address
        if not serving:
            raise RuntimeError("every relay of the tier has died")
        return self.members[serving[index % len(serving)]].address

    def join(self, member: RelayMember, timeout_s: float = 120.0) -> int | None:
        """Put `member`, a replacement relay that is up, at the tail of the chain in a
        new epoch (why the tail: `fnrl.relay.chain.join`), and return the version it
        holds once it holds the newest complete one (None: none was published yet).

        Under a dead relay's name it takes that relay's place in `members` (and its
        launch index, so `homes` resolve to it again). Until it has caught up it is
        forwarded to but not pulled from: `local_address` never names a relay still
        being filled. Raises JoinFailed (and stops it) if it dies or stays behind past
        `timeout_s`; AlreadyInChain if a relay of its name still serves."""
        name = member.name
        with self._lock:
            plan = chain_policy.join(self.plan, name)
            self.members[name] = member   # an existing key keeps its place: the launch order
            self._catching_up.add(name)
            self._misses[name], self._seen[name] = 0, (time.time(), time.monotonic())
            self._pids.pop(name, None)
            if member.proc is not None:
                self._pids[name] = member.proc.pid
                self._owned[member.proc.pid] = member
            if name in self.removed:
                self.removed.remove(name)
            self.plan = plan
            self.configure()
            self.configured_epoch = plan.epoch
        log.warning("relay chain epoch %d: %s (%s joined, catching up)", plan.epoch,
                    " -> ".join(plan.order), name)
        try:
            version = self._catch_up(member, timeout_s)
        except BaseException:
            self._drop_newcomer(name)
            raise
        with self._lock:
            self._catching_up.discard(name)
        log.warning("relay %s serves from version %s", name, version)
        return version

    def _catch_up(self, member: RelayMember, timeout_s: float) -> int | None:
        """Wait until `member` holds the master's newest complete version (asked again
        after each wait: versions published meanwhile reach it by the chain as well)."""
        deadline = time.monotonic() + timeout_s
        wait_s = max(self.cfg.heartbeat_s, 0.5)
        with RelayClient(member.address, timeout_s=self.cfg.heartbeat_timeout_s) as client:
            while True:
                if member.proc is not None and member.proc.poll() is not None:
                    raise JoinFailed(f"relay {member.name} {procs.exit_reason(member.proc)} "
                                     "while catching up")
                if member.name not in self.plan.order:
                    raise JoinFailed(f"relay {member.name} was spliced out while catching up")
                target = self._master_version(member.name)
                try:
                    held = client.ping()["version"]
                    if target is None or (held is not None and held >= target):
                        return held
                    if time.monotonic() > deadline:
                        raise JoinFailed(f"relay {member.name} holds version {held}, not "
                                         f"{target}, after {timeout_s:g} s")
                    client.wait_version(target, timeout_s=wait_s)
                except RelayError:   # not there yet, or a ping lost: asked again
                    if time.monotonic() > deadline:
                        raise JoinFailed(f"relay {member.name} did not catch up to version "
                                         f"{target} in {timeout_s:g} s") from None

    def _master_version(self, newcomer: str) -> int | None:
        """The newest complete version at the master (None: none yet, or the newcomer is
        the master, or the master did not answer: the newcomer then waits no longer)."""
        plan = self.plan
        if plan.master is None or plan.master == newcomer:
            return None
        with RelayClient(self.members[plan.master].address,
                         timeout_s=self.cfg.heartbeat_timeout_s) as client:
            try:
                return client.ping()["version"]
            except RelayError:
                return None

    def _drop_newcomer(self, name: str) -> None:
        """Splice a newcomer that failed to catch up out again (it never served, so no
        repair is recorded) and stop its process."""
        with self._lock:
            self._catching_up.discard(name)
            if name in self.plan.order:
                self.plan = chain_policy.ChainPlan(
                    order=tuple(n for n in self.plan.order if n != name), epoch=self.plan.epoch + 1)
                if self.plan.order:
                    self.configure()
                self.configured_epoch = self.plan.epoch
            if name not in self.removed:
                self.removed.append(name)
        member = self.members[name]
        if member.proc is not None:
            stop_relay(member.proc, name)

    def configure(self) -> None:
        """Send every relay its place in the current plan (master, downstream, epoch)."""
        master = self.master
        for name in self.plan.order:
            down = self.plan.downstream_of(name)
            with RelayClient(self.members[name].address, timeout_s=self.cfg.heartbeat_timeout_s) as c:
                try:
                    c.set_chain(epoch=self.plan.epoch, master=master.name,
                                master_address=master.address,
                                downstream=None if down is None else {
                                    "name": down, "ucx_address": self.members[down].ucx_address})
                except RelayError as err:  # the next check splices it out
                    log.warning("relay %s did not take its chain: %s", name, err)

    def check(self) -> bool:
        """Ping every relay in the chain; splice out the dead (exited, or `heartbeat_misses`
        pings unanswered in a row), elect a new master if the master died, and tell the
        survivors. True if the chain changed."""
        with self._lock:
            alive, versions = [], {}
            for name in self.plan.order:
                member = self.members[name]
                if member.proc is not None and member.proc.poll() is not None:
                    continue
                with RelayClient(member.address, timeout_s=self.cfg.heartbeat_timeout_s) as c:
                    try:
                        ping = c.ping()
                        versions[name] = ping["version"]
                        self._pids.setdefault(name, ping["pid"])
                        self._misses[name] = 0
                        self._seen[name] = (time.time(), time.monotonic())
                    except RelayError:
                        self._misses[name] += 1
                        if self._misses[name] >= self.cfg.heartbeat_misses:
                            continue
                alive.append(name)
            plan = chain_policy.repair(self.plan, alive, versions)
            if plan == self.plan:
                return False
            detected = (time.time(), time.monotonic())
            gone = [n for n in self.plan.order if n not in plan.order]
            # A newcomer lost while catching up never served: its `join` raises instead.
            failed_joins = [n for n in gone if n in self._catching_up]
            gone = [n for n in gone if n not in self._catching_up]
            causes = {n: self._cause(n) for n in gone}
            self.removed += gone + failed_joins
            log.warning("relay chain epoch %d: %s (removed %s)", plan.epoch, " -> ".join(plan.order),
                        {**{n: " ".join(c) for n, c in causes.items()},
                         **{n: "lost while catching up" for n in failed_joins}})
            old_master, self.plan = self.plan.master, plan
            if plan.order:
                self.configure()
            self.configured_epoch = plan.epoch   # survivors have their new places
            repaired = (time.time(), time.monotonic())
            self._events += tuple(ChainRepair(
                relay=n, cause=causes[n][0], detail=causes[n][1], was_master=n == old_master,
                master=plan.master, epoch=plan.epoch, failed_at=self._seen[n][0],
                detected_at=detected[0], repaired_at=repaired[0],
                detection_s=detected[1] - self._seen[n][1], repair_s=repaired[1] - detected[1],
            ) for n in gone)
            return True

    def _cause(self, name: str) -> tuple[str, str]:
        """Why `name` left the chain: ("exited" | "stopped" | "hung", a detail)."""
        proc = self.members[name].proc
        if proc is not None and proc.poll() is not None:
            return "exited", procs.exit_reason(proc)   # the OOM killer named if it was
        pid = self._pids.get(name)
        state = None if pid is None else process_state(pid)
        if state is None and pid is not None:  # not our child, and gone
            return "exited", f"pid {pid} gone"
        if state in ("T", "t"):
            return "stopped", f"pid {pid} stopped (SIGSTOP)"
        return "hung", f"{self._misses[name]} pings unanswered (pid {pid}, state {state})"

    def owns(self, pid: int) -> bool:
        """Whether the relay process `pid` was handed to the tier (`stop` ends it)."""
        return pid in self._owned

    def events(self) -> tuple[ChainRepair, ...]:
        """Every chain repair since the tier started, oldest first (one per relay removed).
        Never waits for a `check` in progress (which may be pinging a hung relay)."""
        return self._events

    def start_monitor(self) -> None:
        """Run `check` every `heartbeat_s` in a daemon thread until `stop`."""

        def loop() -> None:
            while not self._stop.wait(self.cfg.heartbeat_s):
                try:
                    self.check()
                except Exception:  # noqa: BLE001 - the monitor must outlive one bad round
                    log.exception("relay tier check failed")

        self._monitor = threading.Thread(target=loop, name="relay-tier-monitor", daemon=True)
        self._monitor.start()

    def stop_monitor(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the monitor and every relay process the tier was ever given, spliced-out
        ones included: SIGTERM, SIGKILL after `grace_s`, then unlink whatever segments
        each left (a SIGKILLed or stopped relay cannot). Safe to call again."""
        self.stop_monitor()
        for member in list(self._owned.values()):
            if member.proc.poll() is None:
                # A SIGSTOPped relay would hold SIGTERM pending until SIGKILL, and its
                # SIGTERM handler is what unlinks its segments cleanly.
                if isinstance(member.proc, HostedProcess):   # on another node
                    member.proc.send_signal(signal.SIGCONT)
                else:
                    try:
                        os.kill(member.proc.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            stop_relay(member.proc, member.name, grace_s)
