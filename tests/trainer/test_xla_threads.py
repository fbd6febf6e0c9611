"""set_cpu_threads sizes XLA's CPU intra-op pool (checked in fresh processes)."""

import os
import subprocess
import sys

import pytest

from fnrl.trainer.xla_flags import set_cpu_threads

_COUNT_POOL = """
import collections, json, os, sys
from fnrl.trainer.xla_flags import set_cpu_threads
cpus = set_cpu_threads(int(sys.argv[1]))
import jax, jax.numpy as jnp
jax.jit(lambda a: a @ a)(jnp.ones((256, 256))).block_until_ready()
names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip()
                            for t in os.listdir("/proc/self/task"))
print(json.dumps({"cpus": cpus, "pool": names["tf_XLAEigen"],
                  "omp": os.environ["OMP_NUM_THREADS"]}))
"""


def _pool(threads: int) -> dict:
    import json
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no fake devices
    out = subprocess.run([sys.executable, "-c", _COUNT_POOL, str(threads)], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_thread_gives_xla_a_pool_of_one():
    got = _pool(1)
    assert len(got["cpus"]) == 1 and got["pool"] == 1 and got["omp"] == "1"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_zero_keeps_every_allowed_cpu():
    got = _pool(0)
    assert len(got["cpus"]) == len(os.sched_getaffinity(0))
    assert got["pool"] == len(got["cpus"]) and got["omp"] == str(len(got["cpus"]))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_rejects_bad_thread_counts(bad):
    with pytest.raises(ValueError, match="threads"):
        set_cpu_threads(bad)
