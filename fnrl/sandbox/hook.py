"""The weaker sandbox mode ("hook"): persistent worker processes guarded by a Python
audit hook, rlimits and a network namespace (fnrl.sandbox.worker). Used only where the
kernel mode (fnrl.sandbox.kernel) cannot run, and only when the run allows it
(`--sandbox.allow-weaker`): C code and the raw syscalls the preloaded modules expose
get past the hook (docs/environments.md, "The sandbox").

`HookPool` implements fnrl.envs.base.ToolRunner: `await pool.call(name, arguments)`
takes an idle worker (fnrl.sandbox.worker), sends it the call and awaits the reply
with the call's wall-clock timeout, so the event loop keeps serving while tools run.
A call that hangs is cut off at `timeout_s` (its worker's process group is killed); a
call that kills its worker (a crash, SIGXCPU past its CPU time) is reported with the
reason read from the exit status; either way a fresh
worker replaces the dead one and the pool keeps serving. Every worker has a private
temporary directory, removed when it exits, so nothing is left behind; `close()` (or
`async with`) ends them all. `counts` tallies the calls by reason, for metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from fnrl.config.sandbox import SandboxConfig
from fnrl.envs.base import ToolResult

log = logging.getLogger(__name__)

# The worker's entry: fnrl is found from this checkout's root (sys.argv[1]) even when it
# is not installed, since -I ignores PYTHONPATH; the limits are sys.argv[2].
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from fnrl.sandbox.worker import main; main()"
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])

# A worker's exit status -> reason. SIGKILL that the pool did not send is ambiguous (the
# kernel's OOM killer, the CPU hard limit, someone else): it stays "crashed".
_EXIT_REASONS = {-signal.SIGXCPU: "cpu_limit"}


class _Worker:
    """One worker process, its private directory and its call count."""

    def __init__(self, proc: asyncio.subprocess.Process, root: str):
        self.proc, self.root, self.calls = proc, root, 0

    def kill(self) -> None:
        """SIGKILL to its whole process group (tool code cannot outlive it)."""
        kill_group(self.proc.pid)

    async def reap(self) -> int:
        """Waits for the exit, removes the directory; the exit status."""
        rc = await self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
        return rc


class HookPool:
    """Tool calls in audit-hooked workers (see the module docstring). Use as `async with`."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._live: set[_Worker] = set()
        self._next_id = 0
        self.network_mode = ""
        """How workers are kept off the network: "netns", "userns+netns" or "audit_hook"."""
        self.worker_user = ""
        """Which user the workers run as, and why."""
        self.counts: dict[str, int] = {}
        self._closed = False

    async def __aenter__(self) -> HookPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Starts `cfg.workers` workers and logs how the network is cut off."""
        for w in await asyncio.gather(*(self._spawn() for _ in range(self.cfg.workers))):
            self._idle.put_nowait(w)

    async def _spawn(self) -> _Worker:
        root = tempfile.mkdtemp(prefix="fnrl-sandbox-")
        limits = json.dumps(asdict(self.cfg))
        # -I: no PYTHON* variables, no user site, no cwd on sys.path; a minimal environment.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": root, "HOME": root,
               "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _BOOT, _SOURCE_ROOT, limits, cwd=root, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
            limit=4 * self.cfg.max_output_chars + (1 << 16))
        worker = _Worker(proc, root)
        self._live.add(worker)
        try:
            hello = json.loads(await asyncio.wait_for(proc.stdout.readline(),
                                                      self.cfg.start_timeout_s))
        except (asyncio.TimeoutError, json.JSONDecodeError) as e:
            worker.kill()
            rc = await worker.reap()
            self._live.discard(worker)
            raise RuntimeError(f"sandbox worker did not start (exit status {rc}): {e!r}") from e
        if hello["hello"] != self.network_mode:
            self.network_mode = hello["hello"]
            self.worker_user = hello["user"]
            log.info("sandbox network isolation: %s (%s); worker user: %s",
                     hello["hello"], hello["why"], hello["user"])
        return worker

    async def _retire(self, worker: _Worker) -> int:
        worker.kill()
        rc = await worker.reap()
        self._live.discard(worker)
        return rc

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Runs tool `name` ("calculator", "python") on an idle worker; never raises for
        what the tool does: a cut-off call is a ToolResult with its reason."""
        if self._closed:
            raise RuntimeError("HookPool.call after close()")
        worker = await self._idle.get()
        start = time.monotonic()
        self._next_id += 1
        call_id = self._next_id
        request = json.dumps({"id": call_id, "tool": name, "args": dict(arguments)})
        replacement = answered = False
        try:
            worker.proc.stdin.write(request.encode() + b"\n")
            await worker.proc.stdin.drain()
            async with asyncio.timeout(self.cfg.timeout_s):   # not wait_for (kernel.py)
                line = await worker.proc.stdout.readline()
            reply = _reply(line, call_id) if line else None
            if reply is not None:
                text, reason = reply
                answered = True
            elif line:   # forged by tool code, malformed or another call's: not trusted again
                await self._retire(worker)
                replacement = True
                text, reason = "error: the tool's worker sent a reply that is not this call's", \
                    "bad_reply"
            else:   # the worker died during the call
                rc = await self._retire(worker)
                replacement = True
                if self._closed:   # close() killed it: not the tool's doing
                    reason, text = "crashed", "error: the sandbox was closed during the call"
                else:
                    reason = _EXIT_REASONS.get(rc, "crashed")
                    text = f"error: the tool's process ended ({_describe(rc)})"
        except asyncio.TimeoutError:
            await self._retire(worker)
            replacement = True
            text, reason = f"error: the tool ran past its {self.cfg.timeout_s:g} s limit", "timeout"
        except ValueError:   # a line past the pipe's limit (asyncio's LimitOverrunError)
            await self._retire(worker)
            replacement = True
            text, reason = "error: the tool's worker sent an over-long reply", "bad_reply"
        except (BrokenPipeError, ConnectionResetError):
            rc = await self._retire(worker)
            replacement = True
            text, reason = f"error: the tool's process ended ({_describe(rc)})", "crashed"
        finally:
            worker.calls += 1
            # Recycled after its quota, or retired when the call was cancelled mid-way
            # (its reply would still be in the pipe).
            if not replacement and (not answered or worker.calls >= self.cfg.recycle_after):
                await self._retire(worker)
                replacement = True
            # A cancelled call still returns a worker, so the pool never shrinks.
            if self._closed:   # close() ran during the call: nothing comes back
                await self._retire(worker)
            elif replacement:
                self._idle.put_nowait(await self._spawn())
            else:
                self._idle.put_nowait(worker)
        self.counts[reason] = self.counts.get(reason, 0) + 1
        return ToolResult(text=text, reason=reason, elapsed_s=time.monotonic() - start)

    async def close(self) -> None:
        """Kills every worker (idle or busy) and removes their directories; calls in
        flight end as crashed, and the pool takes no more."""
        self._closed = True
        for worker in list(self._live):
            await self._retire(worker)
        while not self._idle.empty():
            self._idle.get_nowait()

    @property
    def pids(self) -> tuple[int, ...]:
        """The live workers' process ids (tests check they are gone after close)."""
        return tuple(w.proc.pid for w in self._live)

    @property
    def idle_workers(self) -> int:
        """Workers waiting for a call."""
        return self._idle.qsize()

    @property
    def dirs(self) -> tuple[str, ...]:
        """The live workers' private directories (removed when each worker ends)."""
        return tuple(w.root for w in self._live)


def kill_group(pid: int) -> None:
    """SIGKILL to the process group `pid` leads, if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_REASONS = frozenset({"ok", "error", "bad_call", "output_limit", "memory", "network",
                      "forbidden"})


def _reply(line: bytes, call_id: int) -> tuple[str, str] | None:
    """(text, reason) of a worker's reply to call `call_id`; None for anything else."""
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    if not (isinstance(reply, dict) and reply.get("id") == call_id
            and isinstance(reply.get("text"), str) and reply.get("reason") in _REASONS):
        return None
    return reply["text"], reply["reason"]


def _describe(rc: int) -> str:
    if rc < 0:
        return f"signal {signal.Signals(-rc).name}"
    return f"exit status {rc}"
