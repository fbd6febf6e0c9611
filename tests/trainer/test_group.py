"""The trainer group's leader (fnrl.trainer.group) with stand-in ranks: each rank gets
its environment, the group file names them, a rank that dies takes the group with it,
no rank outlives the leader, and process 0 hands commands to the others sealed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fnrl.backends.roles import trainer_group_argv
from fnrl.shell import auth
from fnrl.shell.net import free_port
from fnrl.shell.procs import exited
from fnrl.trainer.fanout import CommandFanout, CommandFeed, FanoutError
from fnrl.trainer.group import (FANOUT_VAR, describe_exit, leader_exit_code,
                                rank_environment)
from fnrl.trainer.role import fanout_addresses


def test_rank_environment_and_exit_names():
    env = rank_environment({"A": "1"}, processes=3, rank=2, coordinator="127.0.0.1:9",
                           fanout=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
    assert env == {"A": "1", "FNRL_NUM_PROCESSES": "3", "FNRL_PROCESS_ID": "2",
                   "FNRL_COORDINATOR": "127.0.0.1:9",
                   FANOUT_VAR: "tcp://127.0.0.1:1,tcp://127.0.0.1:2"}
    assert describe_exit(1, -9) == "trainer rank 1 was killed by SIGKILL"
    assert describe_exit(0, 1) == "trainer rank 0 exited with code 1"
    assert leader_exit_code([0, 0]) == 0
    assert leader_exit_code([0, -9, -9]) == 137 and leader_exit_code([3, -9]) == 3


def test_launcher_wraps_the_trainer_in_a_group_on_its_address_host(tmp_path):
    argv = trainer_group_argv(["python", "-m", "fnrl.trainer.role"], 2, "tcp://10.0.0.7:5000",
                              tmp_path / "trainer")
    assert argv[1:] == ["-m", "fnrl.trainer.group", "--processes", "2", "--host", "10.0.0.7",
                        "--name-prefix", str(tmp_path / "trainer"), "--", "python", "-m",
                        "fnrl.trainer.role"]


def test_a_group_started_by_hand_is_told_how_to_start_one():
    with pytest.raises(RuntimeError, match=f"{FANOUT_VAR} is not set"):
        fanout_addresses({})


# A stand-in rank: writes its environment, then sleeps until killed (rank 0 exits 0 after
# a file appears, to test a clean end).
_RANK = """
import json, os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["FNRL_PROCESS_ID"]
(out / f"env{rank}.json").write_text(json.dumps({k: v for k, v in os.environ.items()
                                                 if k.startswith("FNRL_")}))
while not (out / "end").exists():
    time.sleep(0.05)
"""


def _start_leader(tmp_path: Path, processes: int = 3) -> subprocess.Popen:
    log = open(tmp_path / "trainer.log", "ab")
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "fnrl.trainer.group", "--processes", str(processes),
             "--host", "127.0.0.1", "--name-prefix", str(tmp_path / "trainer"), "--",
             sys.executable, "-c", _RANK, str(tmp_path)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_killed_rank_takes_the_group_down(tmp_path):
    leader = _start_leader(tmp_path)
    try:
        _wait_for(lambda: all((tmp_path / f"env{r}.json").exists() for r in range(3))
                  and (tmp_path / "trainer.group.json").exists())
        group = json.loads((tmp_path / "trainer.group.json").read_text())
        assert group["leader"] == leader.pid and len(group["pids"]) == 3
        envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
        assert {e["FNRL_COORDINATOR"] for e in envs} == {group["coordinator"]}
        assert [e["FNRL_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
        assert len(envs[0][FANOUT_VAR].split(",")) == 2
        # Every rank is in the leader's process group: the controller signals them as one.
        assert {os.getpgid(p) for p in group["pids"]} == {leader.pid}
        os.kill(group["pids"][1], signal.SIGKILL)
        assert leader.wait(timeout=30) == 137
        _wait_for(lambda: all(exited(p) for p in group["pids"]), 10)
        assert "trainer rank 1 was killed by SIGKILL; killing the rest of the group" in (
            tmp_path / "trainer.log").read_text()
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()


def test_no_rank_outlives_its_leader_and_a_clean_end_is_zero(tmp_path):
    leader = _start_leader(tmp_path, processes=2)
    _wait_for(lambda: (tmp_path / "env1.json").exists() and (tmp_path / "env0.json").exists()
              and (tmp_path / "trainer.group.json").exists())
    pids = json.loads((tmp_path / "trainer.group.json").read_text())["pids"]
    os.kill(leader.pid, signal.SIGKILL)          # the leader alone: PDEATHSIG ends the ranks
    leader.wait()
    _wait_for(lambda: all(exited(p) for p in pids), 10)

    clean = tmp_path / "clean"
    clean.mkdir()
    leader = _start_leader(clean, processes=2)
    _wait_for(lambda: (clean / "env1.json").exists() and (clean / "env0.json").exists())
    (clean / "end").write_text("")
    assert leader.wait(timeout=30) == 0


def test_fanout_hands_commands_in_order_sealed(monkeypatch):
    monkeypatch.setenv(auth.ENV_VAR, auth.new_secret().hex())
    address = f"tcp://127.0.0.1:{free_port()}"
    fanout = CommandFanout([address])         # before the follower binds: nothing is lost
    fanout.send({"cmd": "init"})
    feed = CommandFeed(address)
    try:
        fanout.send({"cmd": "train"}, {"x": np.arange(6, dtype=np.int32).reshape(2, 3)})
        assert feed.recv() == ({"cmd": "init"}, {})
        header, arrays = feed.recv()
        assert header == {"cmd": "train"} and arrays["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
        # Another run's secret is not a command.
        monkeypatch.setenv(auth.ENV_VAR, auth.new_secret().hex())
        fanout.send({"cmd": "shutdown"})
        with pytest.raises(FanoutError, match="failed its check"):
            feed.recv()
    finally:
        fanout.close()
        feed.close()


def test_each_rank_sees_its_own_slice_of_the_trainer_gpus(tmp_path):
    def visible(base, rank):
        return rank_environment(base, processes=2, rank=rank, coordinator="h:1", fanout=[],
                                gpus_per_process=2)["CUDA_VISIBLE_DEVICES"]
    assert [visible({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, r) for r in (0, 1)] == ["4,5", "6,7"]
    assert [visible({}, r) for r in (0, 1)] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="need 4; CUDA_VISIBLE_DEVICES='4,5'"):
        visible({"CUDA_VISIBLE_DEVICES": "4,5"}, 0)
    # 0 GPUs per process (CPU): the environment is left as it is.
    assert "CUDA_VISIBLE_DEVICES" not in rank_environment(
        {}, processes=2, rank=0, coordinator="h:1", fanout=[])
    argv = trainer_group_argv(["r"], 2, "tcp://10.0.0.7:5000", tmp_path / "t",
                              gpus_per_process=2)
    assert argv[argv.index("--gpus-per-process") + 1] == "2" and argv[-2:] == ["--", "r"]
