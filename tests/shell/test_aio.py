"""fnrl.shell.aio: a job's event loop ends even when a task will not."""

import asyncio
import gc
import logging
import time

from fnrl.shell import aio


async def _deaf() -> None:
    """A task that swallows its cancellation and waits on."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


def test_a_task_deaf_to_cancellation_is_named_and_left_behind(caplog):
    async def main():
        asyncio.create_task(_deaf(), name="deaf")
        polite = asyncio.create_task(asyncio.sleep(3600), name="polite")
        await asyncio.sleep(0)
        return polite

    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="fnrl.shell.aio"):
        polite = aio.run(main(), grace_s=0.5)
    # asyncio.run would wait on the deaf task forever.
    assert time.monotonic() - t0 < 30
    assert polite.cancelled()
    (record,) = caplog.records
    assert "1 task(s) did not end 0.5 s after their cancellation" in record.message
    assert "deaf:" in record.message and "_deaf" in record.message


def test_the_result_and_the_error_of_main_come_through():
    async def ok():
        return 7

    async def fails():
        raise KeyError("x")

    assert aio.run(ok()) == 7
    try:
        aio.run(fails())
    except KeyError:
        pass
    else:
        raise AssertionError("the error of main was lost")


def test_cancel_and_wait_returns_at_once_when_the_tasks_end():
    async def main():
        tasks = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
        t0 = time.monotonic()
        stuck = await aio.cancel_and_wait(tasks, 60.0)
        return stuck, time.monotonic() - t0, tasks

    stuck, waited, tasks = aio.run(main())
    assert stuck == set() and waited < 30 and all(t.cancelled() for t in tasks)


def test_the_errors_of_tasks_that_failed_are_taken_not_printed_at_collection(caplog):
    """A full disk fails every stream task writing to it: the loop's end takes their
    errors, so the job's log does not end in "Task exception was never retrieved"."""
    async def full_disk():
        raise OSError(28, "No space left on device")

    async def main():
        tasks = {asyncio.create_task(full_disk()) for _ in range(3)}
        await asyncio.sleep(0)
        await aio.cancel_and_wait(tasks, 5.0)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        aio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
