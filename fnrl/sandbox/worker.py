"""The sandbox's worker process: confines itself, then runs tool calls one at a time.

Started by fnrl.sandbox.pool as `python -I -c BOOT SOURCE_ROOT LIMITS_JSON` (BOOT
imports this module and calls `main`), with its protocol on stdin/stdout (one JSON
object per line). Before reading any call it:
1. moves the protocol to private descriptors and points fds 0-2 at /dev/null, so tool
   code writing to the raw descriptors cannot corrupt the protocol;
2. leaves the network: unshare(CLONE_NEWNET) (root), else unshare(CLONE_NEWUSER |
   CLONE_NEWNET) (unprivileged user namespaces), else nothing, with the reason reported;
   a new network namespace has no interface up, not even loopback;
3. sets rlimits: address space, file size, no core files, open files, and a lifetime CPU
   budget (the hard limit); each call then gets `cpu_s` more of soft CPU time, and
   SIGXCPU ends the worker when a call overruns it; then, if it runs as root, becomes
   `nobody` (its directory handed over first);
4. installs an audit hook (it cannot be removed) that refuses sockets, new processes,
   signals, ctypes and changing files outside its directory, with an exception tool
   code cannot catch by `except Exception`.
Each call runs in a fresh temporary directory, removed afterwards; what it prints is
captured up to `max_output_chars` (past that, the call is stopped).
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import os
import resource
import sys

# ctypes, shutil, tempfile and traceback are imported where used: a kernel-mode sandbox
# (run_once) starts a fresh interpreter per call, and each module imported at the top is
# paid on every call (these four cost about 12 ms of a 53 ms start on this machine).

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
NOBODY = 65534

_NETWORK_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                   "socket.getaddrinfo", "socket.gethostbyname", "socket.__new__")
_FORBIDDEN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                     "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
                     "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function")


class SandboxViolation(BaseException):
    """Raised by the audit hook; a BaseException so `except Exception` in tool code
    does not swallow it."""

    def __init__(self, kind: str, event: str):
        super().__init__(f"sandbox: {event} is not allowed ({kind})")
        self.kind = kind


class OutputLimit(BaseException):
    """The call printed more than the cap (a BaseException, as above)."""


class _CappedWriter(io.TextIOBase):
    def __init__(self, cap: int):
        self.cap, self.parts, self.size = cap, [], 0

    def write(self, s: str) -> int:
        room = self.cap - self.size
        self.parts.append(s[:max(room, 0)])
        self.size += len(s)
        if self.size > self.cap:
            raise OutputLimit()
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def leave_network() -> tuple[str, str]:
    """Enters a new, empty network namespace if this machine allows it: (mode, why)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return "netns", "unshare(CLONE_NEWNET) succeeded"
    first = os.strerror(ctypes.get_errno())
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "userns+netns", f"CLONE_NEWNET alone failed ({first}); a user namespace allowed it"
    second = os.strerror(ctypes.get_errno())
    return "audit_hook", (f"unshare refused (CLONE_NEWNET: {first}; with CLONE_NEWUSER: "
                          f"{second}); sockets are refused by the audit hook only")


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# Events that change the file system, and which of their arguments are paths.
_PATH_EVENTS = {"os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
                "os.symlink": (1,), "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,),
                "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,),
                "shutil.move": (0, 1), "shutil.copyfile": (1,)}


def make_audit_hook(root: str):
    """The hook that refuses what tool code may not do (see the module docstring).

    Everything it reads is bound here, as frozen values and local names, so that tool
    code rebinding this module's globals (`import fnrl.sandbox.worker`), `os.path.realpath`
    or builtins cannot change what it checks."""
    network, forbidden = frozenset(_NETWORK_EVENTS), frozenset(_FORBIDDEN_EVENTS)
    path_events = dict(_PATH_EVENTS)
    realpath, fsdecode, sep, path_like = os.path.realpath, os.fsdecode, os.sep, os.PathLike
    write_flags, violation = _WRITE_FLAGS, SandboxViolation
    is_a, length = isinstance, len   # builtins can be rebound too

    def inside(event: str, path) -> None:
        if is_a(path, (str, bytes, path_like)):
            full = realpath(fsdecode(path))
            if full != root and not full.startswith(root + sep):
                raise violation("forbidden", f"{event} on {full}")

    def hook(event: str, args: tuple) -> None:
        if event == "open" and length(args) == 3:
            if (args[2] if is_a(args[2], int) else 0) & write_flags:
                inside("writing", args[0])
        elif event in path_events:
            for i in path_events[event]:
                if i < length(args):
                    inside(event, args[i])
        elif event in network:   # every socket family, AF_UNIX included
            raise violation("network", event)
        elif event in forbidden:
            raise violation("forbidden", event)
    return hook


# Imported before privileges are dropped: `nobody` may be unable to read the interpreter's
# standard library (a Python under /root), and tools doing arithmetic want these.
PRELOAD = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools",
           "collections", "heapq", "bisect", "random", "re", "json", "string", "datetime",
           "time", "socket", "encodings.idna", "subprocess")


def drop_privileges(root: str) -> str:
    """Runs the worker as `nobody` when it was started as root: the kernel, not only the
    audit hook, then keeps it from writing outside its directory or signalling others."""
    if os.geteuid() != 0:
        return f"uid {os.geteuid()} (not root: kept)"
    try:
        os.chown(root, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    except OSError as e:
        return f"uid 0 (setuid({NOBODY}) refused: {e.strerror}; the audit hook guards files)"
    return f"uid {NOBODY} (dropped from root)"


def _set_limits(limits: dict, cpu_s: tuple[int, int]) -> None:
    """Address space, file size, open files, no core files, and CPU time (soft, hard)."""
    mib = 1 << 20
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CPU, cpu_s)


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_python(code: str, out: _CappedWriter) -> None:
    """Executes `code`, printing its last expression's value like a REPL."""
    tree = ast.parse(code, mode="exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(tree, "<tool>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
            if value is not None:
                print(repr(value), file=out)
    finally:
        scope.clear()   # a memory bomb's objects go now, before the reply is built


def _with_output(out: _CappedWriter, line: str) -> str:
    """What the call printed before it failed, then the error line."""
    printed = out.text()
    return f"{printed.rstrip()}\n{line}" if printed.strip() else line


def run_call(tool: str, args: dict, cap: int) -> tuple[str, str]:
    """One call in the current directory: (reply text, reason)."""
    from fnrl.envs.calculator import calculate

    out = _CappedWriter(cap)
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    try:
        if tool == "calculator" and isinstance(args.get("expression"), str):
            reply = calculate(args["expression"])
            return reply, "error" if reply.startswith("error:") else "ok"
        if tool == "python" and isinstance(args.get("code"), str):
            _run_python(args["code"], out)
            return out.text(), "ok"
        return f"error: no tool {tool!r} with arguments {sorted(args)}", "bad_call"
    except OutputLimit:
        # The cap plus a marker: the model sees that its output was cut.
        return out.text() + f"\n[output cut at {cap} characters]", "output_limit"
    except MemoryError:
        return "error: MemoryError (the call went over its memory limit)", "memory"
    except SandboxViolation as e:
        return f"error: {e}", e.kind
    except SystemExit as e:
        return _with_output(out, f"error: SystemExit({e.code})"), "error"
    except Exception as e:  # the tool's own error is its reply, as a traceback's last line
        import traceback

        tail = traceback.format_exception_only(type(e), e)[-1].strip()
        # Refused by the kernel (the seccomp filter, a read-only mount, the uid).
        return _with_output(out, f"error: {tail}"), ("forbidden" if isinstance(
            e, PermissionError) else "error")
    finally:
        sys.stdout, sys.stderr = old


def main() -> None:
    limits = json.loads(sys.argv[-1])
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    mode, why = leave_network()
    lifetime = limits["cpu_s"] * (limits["recycle_after"] + 1) + 5   # each call adds cpu_s
    _set_limits(limits, (lifetime, lifetime))
    root = os.path.realpath(os.getcwd())
    for name in PRELOAD + ("fnrl.envs.calculator",):
        __import__(name)
    import shutil
    import tempfile
    import traceback  # noqa: F401 - run_call's, imported while the stdlib is readable
    user = drop_privileges(root)
    sys.addaudithook(make_audit_hook(root))

    def send(obj: dict) -> None:
        proto_out.write(json.dumps(obj).encode() + b"\n")
        proto_out.flush()

    send({"hello": mode, "why": why, "user": user})
    for line in proto_in:
        req = json.loads(line)
        soft = min(int(_cpu_used()) + limits["cpu_s"], resource.getrlimit(resource.RLIMIT_CPU)[1])
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        workdir = tempfile.mkdtemp(dir=root)
        os.chdir(workdir)
        try:
            text, reason = run_call(req["tool"], req.get("args") or {}, limits["max_output_chars"])
        finally:
            os.chdir(root)
            shutil.rmtree(workdir, ignore_errors=True)
        send({"id": req["id"], "text": text[:limits["max_output_chars"] + 64], "reason": reason})


# Kernel mode (fnrl.sandbox.kernel): a call's reason is its sandbox's exit status.
EXIT_CODES = {"ok": 0, "error": 65, "bad_call": 66, "memory": 67, "output_limit": 68,
              "forbidden": 69}
READY = b"fnrl-sandbox-ready\n"


def run_once() -> None:
    """Kernel mode's entry, inside a bubblewrap sandbox (fnrl.sandbox.kernel): sets the
    call's limits, says it is ready, reads one call from stdin, prints its reply text to
    stdout and exits with its reason's code. No hook: the namespaces, the read-only view
    and the seccomp filter around this process are the boundary."""
    limits = json.loads(sys.argv[-1])
    # SIGXCPU at cpu_s (the reason cpu_limit), SIGKILL a second later if it is caught.
    cpu = int(_cpu_used()) + limits["cpu_s"]
    _set_limits(limits, (cpu, cpu + 1))
    # Nothing preloaded but the calculator: the standard library is readable in the
    # sandbox, and every module imported here is paid on every call's start.
    __import__("fnrl.envs.calculator")
    os.write(1, READY)
    req = json.loads(sys.stdin.readline())
    os.close(0)
    cap = limits["max_output_chars"]
    text, reason = run_call(req["tool"], req.get("args") or {}, cap)
    data = text[:cap + 64].encode("utf-8", "replace")
    while data:
        data = data[os.write(1, data):]
    os._exit(EXIT_CODES.get(reason, EXIT_CODES["error"]))


if __name__ == "__main__":
    main()
