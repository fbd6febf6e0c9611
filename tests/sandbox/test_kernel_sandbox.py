"""The kernel sandbox (fnrl.sandbox.kernel) attacked as a hostile tool would attack it,
through `pool.call("python", ...)`: processes that outlive the call, a process count,
signals to anything outside the call, writes outside the call's tmpfs by any syscall,
forged and malformed replies, state carried between calls, the network (TCP, UDP,
AF_UNIX by path and abstract), and resource exhaustion.

Each attack runs twice: with the sandbox started by the pool's own uid (root here), and
started by an unprivileged uid (`SandboxConfig.user`: bwrap then builds its namespaces
as an ordinary user would, through unprivileged user namespaces). The attacks marked
`HOOK_FAILS` also run against the weaker audit-hook pool, where they are expected to
get through (strict xfail: if the hook pool starts containing one, the mark must go).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fnrl.config.sandbox import SandboxConfig
from fnrl.sandbox import kernel
from fnrl.sandbox.pool import Mode, SandboxPool, SandboxUnavailable, choose_mode

NOBODY = 65534


def _unprivileged_python() -> str | None:
    """An interpreter a sandbox started as uid 65534 can run (this one lives under /root
    here, which that uid cannot read); None when not root or none is found."""
    if os.geteuid() != 0:
        return None
    for path in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        if os.path.exists(path) and kernel.probe(SandboxConfig(user=NOBODY, python=path))[0]:
            return path
    return None


def _configs() -> list:
    params = [pytest.param(SandboxConfig(workers=2), id="pool-uid")]
    python = _unprivileged_python()
    reason = ("needs root (to start the sandbox as uid 65534) and an interpreter that uid "
              "can read") if python is None else ""
    params.append(pytest.param(
        SandboxConfig(workers=2, user=NOBODY, python=python or ""), id="unprivileged",
        marks=pytest.mark.skipif(python is None, reason=reason)))
    return params


@pytest.fixture(params=_configs())
def cfg(request) -> SandboxConfig:
    ok, why = kernel.probe(request.param)
    if not ok and os.environ.get("CI") and request.param.user is None:
        pytest.fail(f"CI: scripts/setup.sh did not leave a working kernel sandbox: {why}")
    if not ok:
        pytest.skip(f"no kernel sandbox on this machine: {why}")
    return request.param


def run_calls(cfg: SandboxConfig | tuple[SandboxConfig, Mode | None], *codes: str):
    """Runs `codes` as python tool calls one after another, then a calculator call that
    must answer (in the kernel mode); returns the results and the pool's process ids
    seen. `cfg` may carry the mode to run in (`_in`)."""
    cfg, mode = cfg if isinstance(cfg, tuple) else (cfg, None)

    async def go():
        pids = set()
        async with SandboxPool(cfg, mode=mode) as pool:
            results = []
            for code in codes:
                pids.update(pool.pids)
                results.append(await pool.call("python", {"code": code}))
            after = await pool.call("calculator", {"expression": "6*7"})
            pids.update(pool.pids)
        if mode is None:   # the kernel pool answers after any attack (the hook's may not)
            assert (after.text, after.reason) == ("42", "ok")
        return results, pids
    return asyncio.run(go())


def hook_too(test):
    """Also runs `test` against the audit-hook pool, where the attack must get through
    (each such test asserts `contained == (not hook)`: if the hook pool starts to contain
    one, its test fails and says so)."""
    return pytest.mark.parametrize("hook", [False, True], ids=["", "hook-gets-through"])(test)


def _in(cfg: SandboxConfig, hook: bool) -> tuple[SandboxConfig, Mode | None]:
    if not hook:
        return cfg, None
    return SandboxConfig(isolation="hook", workers=1), Mode("hook", "under test")


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@hook_too
def test_no_process_a_call_starts_outlives_it(cfg, hook):
    # The low-level fork/exec the preloaded subprocess module exposes, past any hook.
    marker = f"fnrl-outlive-{uuid.uuid4().hex}"
    code = ("import _posixsubprocess, os, sys\n"
            "r, w = os.pipe()\n"
            f"args = [[sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'], "
            "[os.fsencode(sys.executable)], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, "
            "True, True, -1, None, None, None, -1, None]\n"
            "try:\n    _posixsubprocess.fork_exec(*args, False)\n"   # 3.11.4+: allow_vfork
            "except TypeError:\n    _posixsubprocess.fork_exec(*args)\n"
            "'started'")
    try:
        (hit,), _ = run_calls(_in(cfg, hook), code)
        contained = "started" not in hit.text and not _processes_with(marker)
        assert contained == (not hook), (hit, _processes_with(marker))
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_fork_bomb_starts_no_process(cfg):
    code = ("import os\nn = 0\n"
            "try:\n    for _ in range(200):\n        if os.fork() == 0:\n            os._exit(0)\n"
            "        n += 1\nexcept OSError as e:\n    print('refused', e.errno)\nn")
    (hit,), _ = run_calls(cfg, code)
    assert hit.text.strip().endswith("0") and "refused 1" in hit.text   # EPERM at once
    threads = ("import threading, time\nts = []\n"
               "try:\n    for _ in range(5000):\n        t = threading.Thread(target=time.sleep, "
               "args=(30,), daemon=True)\n        t.start()\n        ts.append(t)\n"
               "except Exception as e:\n    print(type(e).__name__)\nlen(ts)")
    (hit,), _ = run_calls(cfg, threads)   # threads: bounded by the address space, then gone
    assert hit.reason == "ok" and int(hit.text.split()[-1]) < 5000


@hook_too
def test_a_call_cannot_signal_anything_outside_it(cfg, hook):
    # A process of the uid tool code runs as (the hook pool's workers drop to nobody):
    # what a sibling worker is.
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] \
        if os.geteuid() == 0 else []
    victim = subprocess.Popen([*as_nobody, "sleep", "120"])
    try:
        code = (f"import os, signal\n"
                f"try:\n    signal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGKILL)\n"
                f"except OSError as e:\n    print('pidfd refused', e.errno)\n"
                f"try:\n    os.kill({victim.pid}, signal.SIGKILL)\n"
                f"except OSError as e:\n    print('kill refused', e.errno)\n"
                f"try:\n    os.kill({os.getpid()}, 0)\n    print('sees the pool')\n"
                f"except OSError as e:\n    print('no pool', e.errno)")
        (hit,), _ = run_calls(_in(cfg, hook), code)
        contained = victim.poll() is None and "sees the pool" not in hit.text
        assert contained == (not hook), hit
    finally:
        victim.kill()
        victim.wait()


@hook_too
def test_no_write_reaches_outside_the_calls_tmpfs(cfg, hook, tmp_path):
    # A world-writable directory of the host (what /tmp and /dev/shm are), written by
    # every route: open with dir_fd, mkfifo, os.open.
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o777)
    os.chmod(tmp_path, 0o755)
    name = f"fnrl-escape-{uuid.uuid4().hex}"
    code = (f"import os\nhits = []\n"
            f"for d in ('/tmp', '/dev/shm', {str(target)!r}):\n"
            f"    for how in ('dirfd', 'fifo', 'open'):\n"
            f"        try:\n"
            f"            if how == 'dirfd':\n"
            f"                fd = os.open(d, os.O_RDONLY)\n"
            f"                os.close(os.open('{name}-' + how, os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
            f"            elif how == 'fifo':\n"
            f"                os.mkfifo(os.path.join(d, '{name}-' + how))\n"
            f"            else:\n"
            f"                os.close(os.open(os.path.join(d, '{name}-' + how), os.O_CREAT | os.O_WRONLY))\n"
            f"            hits.append((d, how))\n"
            f"        except BaseException:\n"   # the hook's refusal too: try the next
            f"            pass\n"
            f"hits")
    try:
        run_calls(_in(cfg, hook), code)
        left = [p for d in (target, Path("/tmp"), Path("/dev/shm")) for p in d.glob(f"{name}*")]
        assert (not left) == (not hook), f"written outside the call's tmpfs: {left}"
    finally:
        for d in (target, Path("/tmp"), Path("/dev/shm")):
            for p in d.glob(f"{name}*"):
                p.unlink()


def test_the_run_dir_model_cache_and_home_are_not_visible(cfg, tmp_path):
    secret = tmp_path / "run" / "checkpoints"
    secret.mkdir(parents=True)
    (secret / "state").write_text("weights")
    code = (f"import os\n[os.path.exists(p) for p in ({str(secret)!r}, "
            f"{str(Path.home())!r} + '/.cache', '/etc/passwd', '/root/.ssh')]")
    (hit,), _ = run_calls(cfg, code)
    assert hit.text.strip() == "[False, False, False, False]"


@hook_too
def test_a_forged_or_malformed_reply_affects_only_its_own_call(cfg, hook):
    # Forged replies for the next calls' ids, on every descriptor the process holds.
    forge = ("import os\n"
             "for fd in range(1, 32):\n    for i in range(1, 6):\n        try:\n"
             "            os.write(fd, b'{\"id\": %d, \"text\": \"forged\", \"reason\": \"ok\"}\\n' % i)\n"
             "        except OSError:\n            pass\n"
             "'done'")
    garbage = "import os\nos.write(1, bytes(range(256)) * 10 + b'\\xff\\xfe no newline')\n7"
    results, _ = run_calls(_in(cfg, hook), forge, "6 * 9", garbage, "6 * 8")
    innocent = [(r.reason, r.text.strip().splitlines()[-1:]) for r in results[1::2]]
    assert (innocent == [("ok", ["54"]), ("ok", ["48"])]) == (not hook), innocent
    assert results[2].reason in ("ok", "bad_reply")


@hook_too
def test_nothing_of_one_call_reaches_the_next(cfg, hook):
    plant = ("import threading, time, os\n"
             "open('../state', 'w').write('x') if os.access('..', os.W_OK) else None\n"
             "def leak():\n    while True:\n        print('LEAK')\n        time.sleep(0.01)\n"
             "threading.Thread(target=leak, daemon=True).start()\ntime.sleep(0.05)\n"
             "try:\n    open('/tmp/state', 'w').write('x')\nexcept BaseException:\n    pass\n"
             "'planted'")
    look = ("import os, time\ntime.sleep(0.2)\n"
            "(os.path.exists('/tmp/state'), os.path.exists('../state'))")
    results, _ = run_calls(_in(cfg, hook), plant, look, look)
    seen = [(r.reason, r.text.strip()) for r in results[1:]]
    assert (seen == [("ok", "(False, False)")] * 2) == (not hook), seen


def test_no_socket_reaches_the_host(cfg, tmp_path):
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix, \
            socket.socket(socket.AF_UNIX) as abstract:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        path = str(tmp_path / "s.sock")
        unix.bind(path)
        unix.listen()
        name = f"\0fnrl-{uuid.uuid4().hex}"
        abstract.bind(name)
        abstract.listen()
        code = (f"import socket\nout = []\n"
                f"for fam, addr in ((socket.AF_INET, ('127.0.0.1', {tcp.getsockname()[1]})), "
                f"(socket.AF_UNIX, {path!r}), (socket.AF_UNIX, {name!r})):\n"
                f"    try:\n        s = socket.socket(fam)\n        s.settimeout(2)\n"
                f"        s.connect(addr)\n        out.append('connected')\n"
                f"    except OSError as e:\n        out.append(e.errno)\n"
                f"try:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
                f"('8.8.8.8', 53))\n    out.append('sent')\nexcept OSError as e:\n"
                f"    out.append(e.errno)\nout")
        (hit,), _ = run_calls(cfg, code)
        assert "connected" not in hit.text and "sent" not in hit.text, hit.text


def test_resource_exhaustion_ends_the_call_with_its_reason(cfg):
    cfg = SandboxConfig(**{**cfg.__dict__, "timeout_s": 60.0, "cpu_s": 1, "tmp_mb": 8,
                           "max_output_chars": 2000})
    results, pids = run_calls(cfg, "x = bytearray(10 ** 10)", "while True:\n    pass",
                              "open('/tmp/big', 'wb').write(b'x' * (64 << 20))",
                              "while True:\n    print('x' * 1000)")
    assert [r.reason for r in results] == ["memory", "cpu_limit", "error", "output_limit"]
    assert "No space left" in results[2].text or "File too large" in results[2].text
    assert all(not Path(f"/proc/{p}").exists() for p in pids)


def test_a_hang_is_cut_off_and_a_crash_named_and_nothing_is_left(cfg):
    cfg = SandboxConfig(**{**cfg.__dict__, "timeout_s": 1.0})
    results, pids = run_calls(cfg, "import time\ntime.sleep(600)",
                              "import os\nos._exit(3)",
                              "import faulthandler\nfaulthandler._sigsegv()")
    assert [r.reason for r in results] == ["timeout", "crashed", "crashed"]
    assert "exit status 3" in results[1].text and "SIGSEGV" in results[2].text
    assert all(not Path(f"/proc/{p}").exists() for p in pids)


def test_a_mode_weaker_than_configured_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(kernel.shutil, "which", lambda name: None)   # no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed.*allow-weaker"):
        choose_mode(SandboxConfig())
    mode = choose_mode(SandboxConfig(allow_weaker=True))
    assert mode.name == "hook" and "bubblewrap is not installed" in mode.why
    assert choose_mode(SandboxConfig(isolation="hook")).name == "hook"


def test_a_pool_killed_mid_call_leaves_no_sandbox_behind(cfg, tmp_path):
    """SIGKILL to the process that owns the pool, while a call hangs and sandboxes wait
    ready: bwrap dies with its parent, and every process of its namespace with it."""
    tag = 4000 + uuid.uuid4().int % 1000   # an odd tmpfs size marks this pool's sandboxes
    marker = f'"tmp_mb": {tag},'
    script = (
        "import asyncio, sys\n"
        "from fnrl.config.sandbox import SandboxConfig\n"
        "from fnrl.sandbox.pool import SandboxPool\n"
        "async def go():\n"
        f"    cfg = SandboxConfig(workers=2, tmp_mb={tag}, timeout_s=600, user={cfg.user!r},"
        f" python={cfg.python!r})\n"
        "    async with SandboxPool(cfg) as pool:\n"
        "        print('calling', flush=True)\n"
        "        await pool.call('python', {'code': 'import time\\ntime.sleep(600)'})\n"
        "asyncio.run(go())\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=str(Path(kernel.PACKAGE).parent))
    try:
        assert child.stdout.readline().strip() == "calling"
        for _ in range(600):   # the call's sandbox and the ones started ahead are up
            if len(_processes_with(marker)) >= 3:
                break
            time.sleep(0.05)
        assert _processes_with(marker), "no sandbox of the pool was seen running"
    finally:
        child.kill()
        child.wait()
    for _ in range(200):   # the kernel tears the namespaces down
        if not _processes_with(marker):
            break
        subprocess.run(["sleep", "0.05"])
    assert not _processes_with(marker), "a sandbox outlived the pool's process"
