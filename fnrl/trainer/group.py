"""The trainer role as a group of N JAX processes on one node, started as one process.

    python -m fnrl.trainer.group --processes N --host HOST --name-prefix LOGS/trainer \
        -- python -m fnrl.trainer.role ...

The launchers (fnrl.backends.roles, on this host or on a Ray node) start this leader as
the role "trainer". It starts the N ranks of `fnrl.trainer.role` with FNRL_NUM_PROCESSES,
FNRL_PROCESS_ID and FNRL_COORDINATOR (process 0's coordinator at `HOST` and a free port;
fnrl.trainer.distributed) and FNRL_TRAINER_FANOUT (the addresses on which ranks 1..N-1
take process 0's commands: fnrl.trainer.fanout), then waits. The group lives and dies
as one:

- the ranks share the leader's process group, so the controller's `kill`, `stop` and
  a previous controller's leftover reaping signal all of them at once;
- each rank gets SIGKILL when the leader dies (PR_SET_PDEATHSIG), and the leader when
  its own starter dies, so no rank outlives the job;
- when one rank exits (killed, crashed, or out of memory) the leader kills the rest and
  exits itself, naming the rank: the controller sees one lost trainer and restarts the
  whole group from the step's checkpoint, as it restarts a single trainer.

Rank 0 writes to the leader's log (the controller's error messages quote its tail); rank
k to `<name-prefix>.rank<k>.log`. `<name-prefix>.group.json` records each rank's pid and
the coordinator (for operators and tests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from fnrl.config.distributed import split_host_port
from fnrl.shell.files import write_atomic
from fnrl.shell.net import free_port
from fnrl.shell.procs import die_with_parent

FANOUT_VAR = "FNRL_TRAINER_FANOUT"
"""Comma-separated addresses of ranks 1..N-1's command feeds, in rank order."""


def rank_environment(base: dict[str, str], *, processes: int, rank: int, coordinator: str,
                     fanout: list[str], gpus_per_process: int = 0) -> dict[str, str]:
    """Rank `rank`'s environment: `base` plus the group's shape (the variables
    fnrl.trainer.distributed reads when the config leaves them unset), and with
    `gpus_per_process` > 0 its own GPUs: rank r sees the r-th slice of the leader's
    CUDA_VISIBLE_DEVICES (of GPUs 0.. when that is unset), since a JAX process takes
    every GPU it sees."""
    env = {**base, "FNRL_NUM_PROCESSES": str(processes), "FNRL_PROCESS_ID": str(rank),
           "FNRL_COORDINATOR": coordinator, FANOUT_VAR: ",".join(fanout)}
    if gpus_per_process:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        ids = ([i for i in visible.split(",") if i] if visible is not None
               else [str(i) for i in range(processes * gpus_per_process)])
        if len(ids) < processes * gpus_per_process:
            raise ValueError(f"{processes} processes x {gpus_per_process} GPUs need "
                             f"{processes * gpus_per_process}; CUDA_VISIBLE_DEVICES={visible!r}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            ids[rank * gpus_per_process:(rank + 1) * gpus_per_process])
    return env


def describe_exit(rank: int, code: int) -> str:
    """"trainer rank 1 was killed by SIGKILL" / "trainer rank 0 exited with code 1"."""
    if code < 0:
        return f"trainer rank {rank} was killed by {signal.Signals(-code).name}"
    return f"trainer rank {rank} exited with code {code}"


def leader_exit_code(codes: list[int | None]) -> int:
    """The leader's own exit code once its ranks are done: 0 when every rank exited 0,
    else the first failure's (a signal as 128 + its number, as a shell reports it)."""
    for code in codes:
        if code:
            return 128 - code if code < 0 else code
    return 0


def start_ranks(argv: list[str], processes: int, host: str, prefix: Path,
                gpus_per_process: int = 0) -> tuple[list[subprocess.Popen], str]:
    """Starts the N ranks in this process's group, each dying with this process."""
    coordinator = f"{host}:{free_port(host)}"
    fanout = [f"tcp://{host}:{free_port(host)}" for _ in range(processes - 1)]
    ranks = []
    for rank in range(processes):
        env = rank_environment(dict(os.environ), processes=processes, rank=rank,
                               coordinator=coordinator, fanout=fanout,
                               gpus_per_process=gpus_per_process)
        out = None if rank == 0 else open(f"{prefix}.rank{rank}.log", "ab")
        try:
            ranks.append(subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=None if out is None else subprocess.STDOUT,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL)))
        finally:
            if out is not None:
                out.close()
    return ranks, coordinator


def wait_group(ranks: list[subprocess.Popen]) -> int:
    """Waits until every rank has exited; the first that fails takes the others with it.
    Returns the leader's exit code (`leader_exit_code`)."""
    codes: list[int | None] = [None] * len(ranks)
    pending = {p.pid: i for i, p in enumerate(ranks)}
    while pending:
        pid, status = os.wait()
        if pid not in pending:
            continue
        rank = pending.pop(pid)
        ranks[rank].returncode = codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0 and pending:
            # One rank gone leaves the others blocked in a collective: end them now.
            print(f"fnrl.trainer.group: {describe_exit(rank, codes[rank])}; killing the "
                  "rest of the group", file=sys.stderr, flush=True)
            for other in pending:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return leader_exit_code(codes)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--host", required=True, help="the node's address for the group")
    parser.add_argument("--name-prefix", required=True,
                        help="path prefix of the ranks' logs and the group file")
    parser.add_argument("--gpus-per-process", type=int, default=0,
                        help="GPUs of the leader's each rank sees (0: all of them)")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then a rank's command")
    ns = parser.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if ns.processes < 2:
        raise ValueError(f"--processes={ns.processes}: a group has at least 2 processes")
    if not argv:
        raise ValueError("no rank command after --")
    if split_host_port(f"{ns.host}:1") is None:
        raise ValueError(f"--host={ns.host!r} is not a host name or address")
    prefix = Path(ns.name_prefix)
    ranks, coordinator = start_ranks(argv, ns.processes, ns.host, prefix,
                                     ns.gpus_per_process)
    write_atomic(Path(f"{prefix}.group.json"), json.dumps(
        {"leader": os.getpid(), "coordinator": coordinator,
         "pids": [p.pid for p in ranks]}, indent=2))
    return wait_group(ranks)


if __name__ == "__main__":
    sys.exit(main())
