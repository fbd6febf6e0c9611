"""A failed or interrupted checkpoint save leaves the previous checkpoint restorable.

The interrupted case is real: a subprocess saves a 64 MB state in a loop and is
SIGKILLed while a save is being written, then restarted on the same directory.
"""

import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.trainer.checkpoint import Checkpointer

SIZE = 16_000_000  # float32s: 64 MB, so a save takes long enough to be cut in half


def _state(value: float, size: int = 1000) -> dict:
    return {"w": jnp.full((size,), value, jnp.float32), "count": jnp.asarray(int(value))}


def _assert_restores(directory, step: int, size: int = 1000) -> None:
    ck = Checkpointer(directory)
    try:
        assert ck.latest_step() == step
        state, extra = ck.restore(_state(0.0, size))
        assert extra == {"step": step} and int(state["count"]) == step
        np.testing.assert_array_equal(np.asarray(state["w"]), np.full(size, step, np.float32))
    finally:
        ck.close()


def test_a_save_that_fails_leaves_the_previous_step_restorable(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, _state(1.0), {"step": 1})
    ck.wait()
    # The arrays are written, then the metadata write fails in the background commit.
    ck.save(2, _state(2.0), {"step": 2, "unwritable": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        ck.wait()
    assert ck.latest_step() == 1
    assert sorted(os.listdir(tmp_path)) == ["1", "2.orbax-checkpoint-tmp"]
    _assert_restores(tmp_path, 1)
    # Not wedged: the same step saves on the next try, over the unfinished directory.
    ck.save(2, _state(2.0), {"step": 2})
    ck.wait()
    ck.close()
    _assert_restores(tmp_path, 2)


def _save_forever(directory: str) -> None:
    """The child: resume from the latest step and save the next ones until killed."""
    ck = Checkpointer(directory)
    step = ck.latest_step() or 0
    while True:
        step += 1
        ck.save(step, _state(float(step), SIZE), {"step": step})
        print("writing", step, flush=True)
        ck.wait()
        print("wrote", step, flush=True)


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_latest_finished_step_restorable(tmp_path):
    directory = tmp_path / "ckpt"
    unfinished_seen = 0
    # The kill lands 0..3/4 of the way into writing a save (timed on the save before),
    # so the temporary directory holds nothing, some items, or a half-written array.
    # Kills right at the start of a save all but always find it unfinished.
    for attempt, fraction in enumerate((0.0, 0.25, 0.0, 0.5, 0.0, 0.75)):
        child = subprocess.Popen([sys.executable, __file__, str(directory)],
                                 stdout=subprocess.PIPE, text=True)
        wrote, started, lasted = None, None, None
        for line in child.stdout:
            kind, step = line.split()
            if kind == "wrote":
                wrote, lasted = int(step), time.perf_counter() - started
            elif lasted is None:
                started = time.perf_counter()
            else:
                time.sleep(fraction * lasted)
                os.kill(child.pid, signal.SIGKILL)
                break
        # What the child printed before it died bounds what it can have committed.
        for line in child.stdout:
            kind, step = line.split()
            wrote = int(step) if kind == "wrote" else wrote
        child.wait()
        child.stdout.close()
        assert wrote is not None, f"attempt {attempt}: the child exited early"
        names = os.listdir(directory)
        unfinished_seen += any(not n.isdigit() for n in names)
        finished = max(int(n) for n in names if n.isdigit())
        # The save being written when the kill came may have finished, or not.
        assert finished in (wrote, wrote + 1), (names, wrote)
        _assert_restores(directory, finished, SIZE)
    # Otherwise every kill came too late and the test proved nothing.
    assert unfinished_seen >= 2, unfinished_seen


if __name__ == "__main__":
    _save_forever(sys.argv[1])
