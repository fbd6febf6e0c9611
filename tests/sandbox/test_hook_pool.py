"""The weaker sandbox mode (fnrl.sandbox.hook, `--sandbox.isolation hook`): its workers
contain the five threats (hang, crash, flood, memory bomb, network), report each with
its reason, and keep serving; nothing is left behind. What it does not contain is in
test_kernel_sandbox.py, which the kernel mode passes."""

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from fnrl.config.sandbox import SandboxConfig
from fnrl.sandbox.hook import HookPool as SandboxPool


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def threat_then_recovery(cfg: SandboxConfig, code: str):
    """Runs `code` as a python tool call, then a calculator call; checks the pool."""
    async with SandboxPool(cfg) as pool:
        before, dirs_before = set(pool.pids), pool.dirs
        hit = await pool.call("python", {"code": code})
        after = await pool.call("calculator", {"expression": "6*7"})
        assert (after.text, after.reason) == ("42", "ok")
        assert len(pool.pids) == cfg.workers          # a dead worker was replaced
        pids, dirs, replaced = pool.pids, pool.dirs, before - set(pool.pids)
    # Nothing is left behind: every worker is reaped and every directory removed.
    assert all(gone(p) for p in pids + tuple(before))
    assert not any(os.path.exists(d) for d in dirs + dirs_before)
    return hit, replaced


def test_hang_is_cut_off_at_the_timeout():
    hit, replaced = asyncio.run(threat_then_recovery(
        SandboxConfig(workers=2, timeout_s=1.0), "import time\ntime.sleep(600)"))
    assert hit.reason == "timeout" and "1 s limit" in hit.text and len(replaced) == 1
    assert hit.elapsed_s < 60


def test_busy_loop_is_stopped_by_its_cpu_limit():
    # A wall timeout far above the CPU limit: on a busy machine SIGXCPU still comes first.
    hit, replaced = asyncio.run(threat_then_recovery(
        SandboxConfig(workers=1, timeout_s=120.0, cpu_s=1), "while True:\n    pass"))
    assert hit.reason == "cpu_limit" and "SIGXCPU" in hit.text and len(replaced) == 1


@pytest.mark.parametrize("code, status", [
    ("import os\nos._exit(3)", "exit status 3"),
    ("import faulthandler\nfaulthandler._sigsegv()", "SIGSEGV"),
])
def test_crash_is_reported_and_the_worker_replaced(code, status):
    hit, replaced = asyncio.run(threat_then_recovery(SandboxConfig(workers=2), code))
    assert hit.reason == "crashed" and status in hit.text and len(replaced) == 1


@pytest.mark.parametrize("code", [
    "while True:\n    print('x' * 1000)",
    "import sys\nwhile True:\n    try:\n        sys.stdout.write('y' * 100)\n    except Exception:\n        pass",
])
def test_output_flood_is_cut_at_the_cap(code):
    hit, replaced = asyncio.run(threat_then_recovery(
        SandboxConfig(workers=1, max_output_chars=2000), code))
    assert hit.reason == "output_limit" and "[output cut at 2000 characters]" in hit.text
    assert len(hit.text) < 2100 and not replaced     # cut inside the worker, which lives on


def test_raw_descriptor_flood_cannot_corrupt_the_protocol():
    hit, _ = asyncio.run(threat_then_recovery(
        SandboxConfig(workers=1), "import os\nfor _ in range(1000):\n    os.write(1, b'{' * 1000)\n7"))
    assert (hit.reason, hit.text) == ("ok", "7\n")


@pytest.mark.parametrize("code", [
    "x = bytearray(10 ** 10)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))",
])
def test_memory_bomb_hits_the_address_space_limit(code):
    hit, replaced = asyncio.run(threat_then_recovery(SandboxConfig(workers=1, memory_mb=256), code))
    assert hit.reason == "memory" and "MemoryError" in hit.text and not replaced


def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    return server


def accepted_nothing(server) -> bool:
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def test_network_connection_is_refused():
    with listener() as server:
        port = server.getsockname()[1]
        code = (f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
                "s.sendall(b'leak')")
        hit, replaced = asyncio.run(threat_then_recovery(SandboxConfig(workers=1), code))
        assert hit.reason == "network" and "not allowed" in hit.text and not replaced
        assert accepted_nothing(server)


def test_network_namespace_alone_blocks_loopback():
    """Below the audit hook: a process that left the network reaches nothing, even
    code that bypasses Python's socket checks would find no interface."""
    with listener() as server:
        port = server.getsockname()[1]
        probe = ("from fnrl.sandbox.worker import leave_network\nimport socket\n"
                 "mode, why = leave_network()\nprint(mode)\n"
                 "try:\n    socket.create_connection(('127.0.0.1', %d), timeout=5)\n"
                 "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n" % port)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60).stdout.split("\n")
        if out[0] == "audit_hook":
            pytest.skip("this machine allows no network namespace")
        assert out[1].startswith("refused") and accepted_nothing(server)


def test_files_stay_in_a_private_directory_removed_after_the_call():
    code = ("import os\nopen('scratch.txt', 'w').write('ok')\n"
            "here = os.getcwd()\nhere")
    async def calls():
        async with SandboxPool(SandboxConfig(workers=1)) as pool:
            inside = await pool.call("python", {"code": code})
            outside = await pool.call("python", {"code": "open('/tmp/fnrl-sandbox-escape', 'w')"})
            return inside, outside
    inside, outside = asyncio.run(calls())
    workdir = inside.text.strip().strip("'")
    assert inside.reason == "ok" and not os.path.exists(workdir)
    assert outside.reason == "forbidden" and not os.path.exists("/tmp/fnrl-sandbox-escape")


def test_processes_and_signals_are_refused():
    async def calls():
        async with SandboxPool(SandboxConfig(workers=1)) as pool:
            return [await pool.call("python", {"code": c}) for c in (
                "import subprocess\nsubprocess.run(['true'])", "import os\nos.kill(os.getppid(), 9)")]
    assert [r.reason for r in asyncio.run(calls())] == ["forbidden", "forbidden"]


def test_a_hanging_tool_does_not_block_the_loop_or_other_calls():
    async def calls():
        async with SandboxPool(SandboxConfig(workers=2, timeout_s=30.0)) as pool:
            hang = asyncio.create_task(pool.call("python", {"code": "import time\ntime.sleep(600)"}))
            quick = await pool.call("calculator", {"expression": "2+2"})
            hang_still_running = not hang.done()
            hang.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hang
            # The cancelled call's worker was replaced, not returned with a stale reply.
            again = [await pool.call("calculator", {"expression": "3+3"}) for _ in range(3)]
            return quick, hang_still_running, again, len(pool.pids)
    quick, hang_still_running, again, live = asyncio.run(calls())
    assert quick.text == "4" and hang_still_running
    assert [r.text for r in again] == ["6"] * 3 and live == 2


def test_tool_errors_and_recycling():
    async def calls():
        async with SandboxPool(SandboxConfig(workers=1, recycle_after=1)) as pool:
            seen = []
            for code in ("1/0", "import math\nprint('hi')\nmath.factorial(3) - 1",
                         "raise SystemExit(4)"):
                seen.append((pool.pids, await pool.call("python", {"code": code})))
            bad = await pool.call("shell", {"cmd": "ls"})
            return seen, bad, pool.counts
    seen, bad, counts = asyncio.run(calls())
    assert [r.reason for _, r in seen] == ["error", "ok", "error"]
    assert seen[0][1].text == "error: ZeroDivisionError: division by zero"
    assert seen[1][1].text == "hi\n5\n" and "SystemExit(4)" in seen[2][1].text
    assert len({p for p, _ in seen}) == 3                 # recycle_after=1: a fresh worker each call
    assert bad.reason == "bad_call" and counts == {"error": 2, "ok": 1, "bad_call": 1}


def test_config_is_validated():
    with pytest.raises(ValueError, match="SandboxConfig.memory_mb=32"):
        SandboxConfig(memory_mb=32)
    with pytest.raises(ValueError, match="SandboxConfig.timeout_s=0"):
        SandboxConfig(timeout_s=0)


def test_the_pool_is_an_environments_tool_runner():
    from fnrl.envs.registry import make_env
    from fnrl.types import Problem

    async def episode():
        async with SandboxPool(SandboxConfig(workers=1)) as pool:
            env = make_env("tool_arith", runner=pool)
            await env.reset(Problem(uid="p", prompt="4721*389=", answer="1836469", level=4))
            first = await env.step("<calc>4721*389</calc>")
            return first, await env.step("#### 1836469"), dict(pool.counts)
    first, last, counts = asyncio.run(episode())
    assert first.observation == "<result>1836469</result>" and last.reward == 1.0
    assert counts == {"ok": 1}


@pytest.mark.skipif(os.geteuid() != 0, reason="privileges are dropped only from root")
def test_a_root_pool_runs_its_tools_as_nobody():
    async def call():
        async with SandboxPool(SandboxConfig(workers=1)) as pool:
            return await pool.call("python", {"code": "import os\nos.getuid(), os.getgid()"}), pool
    got, pool = asyncio.run(call())
    assert got.text == "(65534, 65534)\n" and pool.worker_user.startswith("uid 65534")


def test_close_during_a_call_ends_it_and_leaves_nothing():
    async def calls():
        pool = SandboxPool(SandboxConfig(workers=1, timeout_s=60.0))
        await pool.start()
        busy = asyncio.create_task(pool.call("python", {"code": "import time\ntime.sleep(600)"}))
        while pool.idle_workers:      # until the call has taken the worker
            await asyncio.sleep(0.01)
        pids, dirs = pool.pids, pool.dirs
        await pool.close()
        result = await busy
        with pytest.raises(RuntimeError, match="after close"):
            await pool.call("calculator", {"expression": "1"})
        return result, pids, dirs, pool.pids
    result, pids, dirs, left = asyncio.run(calls())
    assert result.reason == "crashed" and left == ()
    assert all(gone(p) for p in pids) and not any(os.path.exists(d) for d in dirs)


def test_rebinding_the_workers_globals_does_not_disarm_the_hook():
    tamper = ("import builtins, os\nimport fnrl.sandbox.worker as w\n"
              "w._NETWORK_EVENTS = w._FORBIDDEN_EVENTS = ()\nw._PATH_EVENTS = {}\n"
              "w._WRITE_FLAGS = 0\nos.path.realpath = lambda p: os.getcwd()\n"
              "builtins.isinstance = lambda *a: False\n")
    async def calls():   # recycle_after=1: each tampering starts from a clean worker
        async with SandboxPool(SandboxConfig(workers=1, recycle_after=1)) as pool:
            return [await pool.call("python", {"code": tamper + c}) for c in (
                "import socket\nsocket.socket()", "open('/tmp/fnrl-sandbox-escape', 'w')")]
    assert [r.reason for r in asyncio.run(calls())] == ["network", "forbidden"]
    assert not os.path.exists("/tmp/fnrl-sandbox-escape")
