"""Role handles over local processes: the trainer as a ZeroMQ child process (with an
optional warm standby), vLLM HTTP servers, and the relay tier, all started by
`fnrl.backends.roles.Cluster` on this host. They implement fnrl.control.handles."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Mapping, Sequence

import aiohttp
import numpy as np

from fnrl.control.handles import RelayEvent, TrainResult
from fnrl.backends.roles import EVAL_SERVER, Cluster
from fnrl.serving.client import RolloutClient
from fnrl.shell import procs
from fnrl.shell.wire import RoleClient, RoleError

EventSink = Callable[..., None]   # (event, **fields): written to the run's faults.jsonl


class LocalTrainer:
    """The trainer process (fnrl.trainer.role). With `standby`, a warm spare (built,
    restored and compiled, waiting) takes over a failed trainer (RobustRL §3.2)."""

    name = "trainer"

    def __init__(self, cluster: Cluster, *, timeout_s: float, standby: bool = False,
                 record: EventSink = lambda event, **fields: None):
        self.cluster, self.timeout_s, self.record = cluster, timeout_s, record
        self.use_standby = standby
        self.client = self._client("trainer")
        self._standby: RoleClient | None = None
        self._standby_ready = False
        self._warming = False
        self._shapes: set = set()
        self._tasks: set[asyncio.Task] = set()

    def _client(self, name: str) -> RoleClient:
        role = self.cluster.role(name)
        return RoleClient(name, role.address, role.proc, str(role.log_path))

    async def _call(self, client: RoleClient, header: dict, arrays=None) -> dict:
        # The socket is blocking: one call at a time per client, off the event loop.
        return await asyncio.to_thread(client.call, header, arrays, timeout_s=self.timeout_s)

    def exit_code(self) -> int | None:
        return self.client.proc.poll()

    def exit_reason(self) -> str | None:
        return None if self.exit_code() is None else procs.exit_reason(self.client.proc)

    async def init(self) -> tuple[int, int | None]:
        reply = await self._call(self.client, {"cmd": "init"})
        self._background(self._start_standby())
        return reply["version"], reply["resumed_from"]

    async def train(self, arrays: Mapping[str, np.ndarray]) -> TrainResult:
        reply = await self._call(self.client, {"cmd": "train"}, arrays)
        shape = tuple(sorted((k, v.shape) for k, v in arrays.items()))
        if shape not in self._shapes:   # the spare compiles every new batch shape too
            self._shapes.add(shape)
            self._background(self._warm_standby())
        return TrainResult(reply["version"], reply["metrics"])

    async def restart(self) -> int:
        # A spare still warming up is taken too: it is ahead of a process started now.
        standby, ready = self._standby, self._standby_ready
        self._standby, self._standby_ready = None, False
        self.kill()
        if standby is not None and standby.proc.poll() is None:
            self.cluster.promote("trainer_standby", "trainer")
            if ready:   # (a socket still waiting for its reply is left to its thread)
                standby.close()
            cmd = "takeover"
        else:
            self.cluster.restart_trainer()
            cmd = "init"
        # Published once it answered: a train call made meanwhile goes to the dead client
        # and fails (a REQ socket must never carry two calls at once).
        client = self._client("trainer")
        reply = await self._call(client, {"cmd": cmd})
        self.client = client
        self.record("trainer_started", how=cmd, version=reply["version"])
        self._background(self._start_standby())
        return reply["version"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.cluster.kill("trainer", sig=sig)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self._call(self.client, {"cmd": "shutdown"})

    def _background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_standby(self) -> None:
        if not self.use_standby or self._standby is not None:
            return
        self.cluster.restart_trainer(name="trainer_standby")
        client = self._client("trainer_standby")
        self._standby, self._standby_ready = client, False
        try:
            reply = await self._call(client, {"cmd": "standby"})
        except RoleError as err:
            if self._standby is client:   # no spare: a failure restarts from scratch
                self._standby = None
                self.record("standby_failed", error=str(err)[:2000])
            return
        if self._standby is client:       # not taken over while it warmed up
            self._standby_ready = True
            self.record("standby_ready", warmed_shapes=reply["warmed"])

    async def _warm_standby(self) -> None:
        standby = self._standby
        if standby is None or not self._standby_ready or self._warming:
            return
        self._warming = True
        try:
            await self._call(standby, {"cmd": "warm"})
        except RoleError:
            pass   # it is checked for life at takeover
        finally:
            self._warming = False


class HttpRollout:
    """A vLLM OpenAI-compatible server with fnrl's worker extension."""

    def __init__(self, cluster: Cluster, rid: int, session: aiohttp.ClientSession, *,
                 timeout_s: float, start_timeout_s: float):
        self.cluster, self.rid, self.name = cluster, rid, f"rollout{rid}"
        self.session, self.timeout_s, self.start_timeout_s = session, timeout_s, start_timeout_s
        self.client = RolloutClient(cluster.role(self.name).address, session, timeout_s=timeout_s)

    def exit_code(self) -> int | None:
        return self.cluster.role(self.name).proc.poll()

    def exit_reason(self) -> str | None:
        return None if self.exit_code() is None else self.cluster.exit_reason(self.name)

    async def kv_capacity_tokens(self) -> int:
        return await self.client.kv_capacity_tokens()

    async def generate(self, prompt_ids: Sequence[int], **kw):
        return await self.client.generate(prompt_ids, **kw)

    def generate_stream(self, prompt_ids: Sequence[int], **kw):
        return self.client.generate_stream(prompt_ids, **kw)

    async def pull(self, relay_address: str, *, min_version: int = -1,
                   relay_timeout_s: float = 30.0) -> int:
        return await self.client.pull(relay_address, min_version=min_version,
                                      relay_timeout_s=relay_timeout_s)

    async def metrics(self) -> Mapping[str, float]:
        return await self.client.metrics()

    async def restart(self) -> float:
        self.kill()
        self.cluster.restart_server(self.rid)
        # Its port may be taken before it binds: then it starts again on another.
        seconds = await asyncio.to_thread(self.cluster.wait_server_ready, self.name,
                                          self.start_timeout_s)
        self.client = RolloutClient(self.cluster.role(self.name).address, self.session,
                                    timeout_s=self.timeout_s)
        return seconds

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.cluster.kill(self.name, sig=sig, wait=False)


class HttpEvalServer:
    """The dedicated evaluation server: a vLLM server like a rollout's, never routed
    training work (fnrl.control.eval_lane); implements EvalServerHandle."""

    def __init__(self, cluster: Cluster, session: aiohttp.ClientSession, *, timeout_s: float):
        self.cluster, self.name = cluster, EVAL_SERVER
        self.client = RolloutClient(cluster.role(self.name).address, session, timeout_s=timeout_s)

    def exit_code(self) -> int | None:
        return self.cluster.role(self.name).proc.poll()

    def exit_reason(self) -> str | None:
        return None if self.exit_code() is None else self.cluster.exit_reason(self.name)

    async def generate(self, prompt_ids: Sequence[int], **kw):
        return await self.client.generate(prompt_ids, **kw)

    async def pull_version(self, relay_address: str, version: int, *,
                           relay_timeout_s: float = 30.0) -> int:
        return await self.client.pull(relay_address, version=version,
                                      relay_timeout_s=relay_timeout_s)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.cluster.kill(self.name, sig=sig, wait=False)


class LocalRelays:
    """The relay tier of `cluster` (its monitor splices dead relays out; `replace` starts
    a relay that exited again, on its node)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.tier = cluster.relay_tier
        self.names = tuple(self.tier.members)

    def address_for(self, rid: int) -> str:
        return self.tier.local_address(rid)

    def check(self) -> None:
        self.cluster.check()

    def events(self) -> tuple[RelayEvent, ...]:
        return tuple(RelayEvent(e.relay, e.cause, e.failed_at, e.repaired_at, e.master,
                                e.was_master) for e in self.tier.events())

    async def replace(self, name: str) -> dict:
        # Spawned from the loop's thread (it outlives the job's roles: PR_SET_PDEATHSIG),
        # then waited for in a thread: its start and its catch-up take seconds.
        role = self.cluster.start_replacement_relay(name)
        version = await asyncio.to_thread(self.cluster.join_relay, role)
        return {"address": role.address, "version": version, "pid": role.proc.pid}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.cluster.kill(name, sig=sig, wait=False)
