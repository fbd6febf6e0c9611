"""Tool calls isolated by the kernel: every call runs in a fresh bubblewrap sandbox.

Each sandbox is `bwrap` (Debian's `bubblewrap`) around one interpreter
(fnrl.sandbox.worker.run_once), with
- new user, pid, mount, IPC, UTS, cgroup and network namespaces (the network has only a
  loopback of its own, so no socket, AF_UNIX or abstract, reaches anything outside);
- a read-only view of /usr, the interpreter's prefix and the `fnrl` package alone: no run
  dir, model cache, /dev/shm, /tmp or home of the host; a private tmpfs of `tmp_mb` as
  /tmp, the call's working directory; a /proc of its own pid namespace;
- no capabilities, no new privileges, a seccomp filter (fnrl.sandbox.seccomp) that
  refuses new processes, namespaces, tracing and the administrative syscalls;
- rlimits set before the call is read: address space, file size, open files, no core
  files, CPU time (SIGXCPU at `cpu_s`).

bwrap is the sandbox's pid 1 and dies with the pool (`--die-with-parent`); when it dies
the kernel kills every process of its pid namespace, so nothing a call started outlives
it. The reply is the call's own output pipe and exit status, read by the pool: a call
can write only its own reply, so nothing it prints reaches another call, and nothing
it prints can make `call` raise. Each sandbox serves one call; `workers` of them are
started ahead, so a call does not wait for an interpreter to start.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from fnrl.config.sandbox import SandboxConfig
from fnrl.envs.base import ToolResult
from fnrl.sandbox import seccomp
from fnrl.sandbox.hook import kill_group
from fnrl.sandbox.worker import EXIT_CODES, READY

PACKAGE = Path(__file__).resolve().parents[1]        # the `fnrl` package directory
INSIDE = "/opt/fnrl"                                 # where the sandbox sees its parent
_BOOT = (f"import sys; sys.path.insert(0, {INSIDE!r}); "
         "from fnrl.sandbox.worker import run_once; run_once()")
_REASONS = {code: reason for reason, code in EXIT_CODES.items()}
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def interpreter(cfg: SandboxConfig) -> str:
    """The Python tools run in: `cfg.python`, else this one's base interpreter (a venv's
    `python` is a link to it; the sandbox needs the standard library, not the venv)."""
    return os.path.realpath(cfg.python or sys.executable)


def command(cfg: SandboxConfig, seccomp_fd: int | None) -> list[str]:
    """The bwrap command line of one sandbox (see the module docstring)."""
    python = interpreter(cfg)
    prefix = str(Path(python).parents[1])
    argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534",
            "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--ro-bind", "/usr", "/usr"]
    for name in _ROOT_LINKS:   # merged /usr: links; otherwise the directories, read-only
        path = Path("/") / name
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    if not prefix.startswith("/usr/") and prefix != "/usr":
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--ro-bind", str(PACKAGE), f"{INSIDE}/fnrl", "--proc", "/proc", "--dev", "/dev",
             "--size", str(cfg.tmp_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    limits = json.dumps(asdict(cfg))
    return argv + ["--", python, "-I", "-S", "-B", "-c", _BOOT, limits]


def _as_user(uid: int | None):
    """preexec_fn: become `uid` (from root) before exec'ing bwrap, or nothing."""
    if uid is None or os.geteuid() != 0:
        return None

    def become() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return become


class _Sandbox:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    def kill(self) -> None:
        """SIGKILL to bwrap: its pid 1 dies with it (--die-with-parent), and with that the
        kernel ends every process of the sandbox's pid namespace."""
        kill_group(self.proc.pid)

    async def end(self) -> None:
        """Kills it and drains its pipe to the end (its transport closes with it)."""
        self.kill()
        await self.proc.stdout.read()
        await self.proc.wait()


class KernelPool:
    """Tool calls in bubblewrap sandboxes (see the module docstring). Use as `async with`."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self.counts: dict[str, int] = {}
        self._filter: bytes | None = None     # the compiled seccomp filter (BPF)
        self._ready: asyncio.Queue[asyncio.Task[_Sandbox]] = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.cfg.workers)
        self._live: set[_Sandbox] = set()
        self._closed = False

    async def __aenter__(self) -> KernelPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Compiles the filter and starts `workers` sandboxes; raises RuntimeError with
        bwrap's own words if one cannot start."""
        self._filter = seccomp.compile_filter()
        first = [asyncio.ensure_future(self._spawn()) for _ in range(self.cfg.workers)]
        try:
            await asyncio.gather(*first)
        except BaseException:
            for task in first:
                if task.done() and not task.exception():
                    task.result().kill()
            await self.close()
            raise
        for task in first:
            self._ready.put_nowait(task)

    async def _spawn(self) -> _Sandbox:
        fd = _memfd(self._filter) if self._filter else None
        try:
            proc = await asyncio.create_subprocess_exec(
                *command(self.cfg, fd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(fd,) if fd is not None else (), preexec_fn=_as_user(self.cfg.user))
        finally:
            if fd is not None:
                os.close(fd)
        sandbox = _Sandbox(proc)
        self._live.add(sandbox)
        try:
            async with asyncio.timeout(self.cfg.start_timeout_s):
                line = await proc.stdout.readline()
        except TimeoutError:
            line = b""
        if line != READY:
            sandbox.kill()
            rest = line + await proc.stdout.read()
            await proc.wait()
            self._live.discard(sandbox)
            raise RuntimeError(f"a tool sandbox did not start (bwrap exit status "
                               f"{proc.returncode}): {rest.decode(errors='replace').strip()}")
        return sandbox

    async def _take(self) -> _Sandbox | str:
        """A started sandbox (a new one starts in its place), or why none could start."""
        task = await self._ready.get()
        self._ready.put_nowait(asyncio.ensure_future(self._spawn()))
        try:
            return await task
        except RuntimeError as err:
            return str(err)

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Runs tool `name` ("calculator", "python") in a fresh sandbox; never raises
        for what the tool does: a cut-off or failed call is a ToolResult with its reason."""
        if self._closed:
            raise RuntimeError("KernelPool.call after close()")
        async with self._slots:
            start = time.monotonic()
            sandbox = await self._take()
            if isinstance(sandbox, str):
                text, reason = f"error: {sandbox}", "crashed"
            else:
                try:
                    text, reason = await self._run(sandbox, name, arguments)
                finally:   # a cancelled call too
                    await sandbox.end()
                    self._live.discard(sandbox)
        self.counts[reason] = self.counts.get(reason, 0) + 1
        return ToolResult(text=text, reason=reason, elapsed_s=time.monotonic() - start)

    async def _run(self, sandbox: _Sandbox, name: str, arguments) -> tuple[str, str]:
        proc, cap = sandbox.proc, self.cfg.max_output_chars
        # Room for the cap in UTF-8 and the runner's marker; past it the call is cut.
        room = 4 * cap + 256

        async def exchange() -> tuple[bytes, int | None]:
            proc.stdin.write(json.dumps({"tool": name, "args": dict(arguments)}).encode()
                             + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
            out = await _read_capped(proc.stdout, room)
            return out, (None if len(out) > room else await proc.wait())
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can return the
            # result and drop a cancellation that lands as the call ends, and a cancelled
            # episode must not go on with its tool's reply.
            async with asyncio.timeout(self.cfg.timeout_s):
                out, rc = await exchange()
        except TimeoutError:
            return f"error: the tool ran past its {self.cfg.timeout_s:g} s limit", "timeout"
        except (BrokenPipeError, ConnectionResetError):
            out, rc = b"", await proc.wait()
        if rc is None:
            text = out[:room].decode("utf-8", "replace")[:cap]
            return text + f"\n[output cut at {cap} characters]", "output_limit"
        text = out.decode("utf-8", "replace")
        if self._closed:
            return "error: the sandbox was closed during the call", "crashed"
        if rc in _REASONS:
            return text, _REASONS[rc]
        if rc == 128 + signal.SIGXCPU:
            return "error: the tool's process ended (signal SIGXCPU)", "cpu_limit"
        how = _status(rc)
        return (f"{text.rstrip()}\n" if text.strip() else "") + \
            f"error: the tool's process ended ({how})", "crashed"

    async def close(self) -> None:
        """Kills every sandbox (calls in flight end as crashed); the pool takes no more
        calls."""
        self._closed = True
        while not self._ready.empty():   # started ahead: awaited, never cancelled mid-start
            try:
                (await self._ready.get_nowait()).kill()
            except RuntimeError:
                pass
        for sandbox in list(self._live):
            await sandbox.end()
        self._live.clear()

    @property
    def pids(self) -> tuple[int, ...]:
        """The live sandboxes' bwrap process ids (tests check they are gone after close)."""
        return tuple(s.proc.pid for s in self._live)


def _memfd(data: bytes) -> int:
    """An anonymous in-memory file holding `data`, at offset 0 (bwrap reads the filter
    from it; nothing is left on any disk, whatever ends the pool)."""
    fd = os.memfd_create("fnrl-seccomp")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _status(rc: int) -> str:
    """bwrap's exit status in words (it exits 128 + N when its child died of signal N)."""
    if 128 < rc < 192:
        try:
            return f"signal {signal.Signals(rc - 128).name}"
        except ValueError:
            return f"signal {rc - 128}"
    return f"exit status {rc}"


async def _read_capped(stream: asyncio.StreamReader, room: int) -> bytes:
    """Everything until EOF, or the first `room` + 1 bytes (past the room: cut)."""
    chunks, size = [], 0
    while size <= room:
        chunk = await stream.read(room + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def probe(cfg: SandboxConfig) -> tuple[bool, str]:
    """(whether a sandbox with the seccomp filter starts here, and what was found): run
    at a job's start, before any role, so a machine without it is told at once."""
    if shutil.which("bwrap") is None:
        return False, ("bubblewrap is not installed (Debian/Ubuntu: apt-get install "
                       "bubblewrap; scripts/setup.sh does it)")
    bpf = seccomp.compile_filter()
    if bpf is None:
        return False, "libseccomp (libseccomp.so.2) is not installed: no seccomp filter"
    fd = _memfd(bpf)
    try:
        argv = command(cfg, fd)
        argv[argv.index("-c") + 1] = "print('ok')"
        done = subprocess.run(argv, pass_fds=(fd,), capture_output=True,
                              timeout=cfg.start_timeout_s, preexec_fn=_as_user(cfg.user))
    except subprocess.TimeoutExpired:
        return False, f"a bubblewrap sandbox did not start in {cfg.start_timeout_s:g} s"
    finally:
        os.close(fd)
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        said = (done.stderr or done.stdout).decode(errors="replace").strip()[-500:]
        return False, (f"a bubblewrap sandbox failed here (exit status {done.returncode}): "
                       f"{said} (unprivileged user namespaces may be disabled: "
                       "sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces)")
    return True, (f"bubblewrap {_bwrap_version()}: user, pid, mount, IPC, UTS, network "
                  "namespaces; read-only view; seccomp filter; "
                  f"{'uid ' + str(cfg.user) if cfg.user and os.geteuid() == 0 else 'the pool uid'}"
                  " outside")


def _bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                              timeout=10).stdout.split()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "(version unknown)"
