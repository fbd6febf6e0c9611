"""Joining a Ray cluster (`--cluster.backend ray`) cannot hang a start: no cluster, a stale
address (the file `ray start` left, or RAY_ADDRESS) and a dead flag address are each a
one-line `fnrl:` message within the connection deadline, before the run directory is
written; SIGTERM and Ctrl-C act during the wait (fnrl.backends.ray_cluster)."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

from fnrl.experiments.math_grpo import main  # noqa: E402
from fnrl.shell.net import free_port  # noqa: E402


@pytest.fixture
def no_cluster(tmp_path, monkeypatch):
    """Ray's temporary directory (where `ray start` records its address) of this test
    only, and no RAY_ADDRESS."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path / "raytmp" / "ray" / "ray_current_cluster"


def _job(tmp_path, *flags):
    return ["--cluster.backend", "ray", "--run-dir", str(tmp_path / "run"), *flags]


def test_no_cluster_is_one_line_naming_the_flag_before_anything_is_written(
        tmp_path, no_cluster, capsys):
    assert main(_job(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fnrl: cluster.backend='ray' found no Ray cluster")
    assert "--cluster.ray-address" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("source", ["file", "variable", "flag"])
def test_a_stale_address_is_named_with_where_it_came_from_within_the_deadline(
        tmp_path, no_cluster, capsys, monkeypatch, source):
    dead = f"127.0.0.1:{free_port()}"   # nothing listens there
    flags = ["--cluster.connect-timeout-s", "2"]
    if source == "file":
        no_cluster.parent.mkdir(parents=True)
        no_cluster.write_text(dead)
    elif source == "variable":
        monkeypatch.setenv("RAY_ADDRESS", dead)
    else:
        flags += ["--cluster.ray-address", dead]
    t0 = time.monotonic()
    assert main(_job(tmp_path, *flags)) == 2
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fnrl: no Ray cluster answers at {dead} (from ")
    assert "stale" in err and "--cluster.ray-address" in err and "\n" not in err
    where = {"file": str(no_cluster), "variable": "the RAY_ADDRESS variable",
             "flag": "--cluster.ray-address"}[source]
    assert f"(from {where}" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, -signal.SIGTERM),
                                      (signal.SIGINT, 128 + signal.SIGINT)])
def test_a_stop_signal_acts_while_the_job_waits_for_its_cluster(tmp_path, sig, code):
    dead = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, RAY_TMPDIR=str(tmp_path / "raytmp"))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnrl.experiments.math_grpo",
         *_job(tmp_path, "--cluster.ray-address", dead, "--cluster.connect-timeout-s", "600")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        # As a job started at a terminal: a background test run inherits SIGINT ignored,
        # and Python keeps an ignored SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()   # said before it waits
        assert line.startswith(f"fnrl: waiting for the Ray cluster at {dead}"), line
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "run").exists()
