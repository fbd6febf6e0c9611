"""Role processes never outlive the job that started them.

`die_with_parent` (a `preexec_fn`, or called at import in a child vLLM spawns) asks the
kernel to SIGKILL the process when the thread that forked it ends. `reap_leftovers`
kills what a controller killed before its children could be told (a SIGKILL leaves no
chance) left behind: every process in the process groups its roles.json names.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

_OURS = (b"fnrl", b"vllm", b"VLLM")


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL) on Linux; a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Fields after the parenthesised command: state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if any(tag in cmdline for tag in _OURS):
            members.append(int(entry.name))
    return members


def reap_leftovers(roles_json: Path) -> int:
    """SIGKILLs the surviving members of the role process groups a previous controller
    of this run recorded (each role leads its own session, so its pgid is its pid);
    returns how many processes were killed. Only processes whose command line is ours
    (fnrl, vLLM) are touched, so a recycled pid is left alone."""
    if not sys.platform.startswith("linux") or not roles_json.exists():
        return 0
    try:
        roles = json.loads(roles_json.read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    killed = 0
    for info in roles.values():
        for pid in _group_members(int(info["pid"])):
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
