"""Seeds and orders of deterministic runs (fnrl.policy.seeding)."""

import subprocess
import sys

import pytest

from fnrl.policy.seeding import SEED_BITS, canonical_order, request_seed


def test_request_seed_names_the_work_not_the_process():
    # Golden value: the same in every process and Python (no salted `hash`).
    seed = request_seed(0, "p7/3", 0)
    code = "from fnrl.policy.seeding import request_seed; print(request_seed(0, 'p7/3', 0))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert int(other.stdout) == seed
    assert 0 <= seed < 1 << SEED_BITS


def test_request_seed_differs_by_run_trajectory_and_continuation():
    seeds = {request_seed(s, uid, n) for s in (0, 1) for uid in ("p1/0", "p1/1", "p2/0")
             for n in (0, 5)}
    assert len(seeds) == 12


def test_request_seed_rejects_a_negative_count():
    with pytest.raises(ValueError, match="streamed=-1"):
        request_seed(0, "p1/0", -1)


def test_canonical_order_is_draw_order_whatever_the_arrival():
    assert canonical_order((5, 2, 9, 3)) == (2, 3, 5, 9)
    assert canonical_order((3, 9, 2, 5)) == canonical_order((5, 2, 9, 3))
