"""`asyncio.run` with a bounded end: a job that was told to stop must exit.

`asyncio.run` cancels the tasks still pending when its coroutine returns and then waits
for every one of them, with no limit: one task that does not end on its cancellation
(seen once in a full-suite run: the job's SIGTERM stopped every role, the attempt
returned, and the process sat in `_cancel_all_tasks` until the test's 300 s ran out)
keeps the whole job alive, its roles already gone. `run` waits `grace_s` for them
instead, names each straggler with its stack in the log, and closes the loop without
it, so the job still exits with its own code and the log says what would have hung.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Coroutine, Iterable

log = logging.getLogger(__name__)


def describe(tasks: Iterable[asyncio.Task]) -> str:
    """Each task's name, coroutine and where it waits (its stack)."""
    out = io.StringIO()
    for task in tasks:
        out.write(f"{task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(limit=8, file=out)
    return out.getvalue()


async def cancel_and_wait(tasks: Iterable[asyncio.Task], grace_s: float) -> set[asyncio.Task]:
    """Cancels `tasks` and waits up to `grace_s` for them to end; returns those that did
    not (after logging them). The errors of those that failed are taken (logged at debug
    level): the caller is unwinding, its own error or result is the one that counts, and
    an error never taken is printed as "Task exception was never retrieved" when the
    task is collected (a full disk fails every stream writing to it)."""
    tasks = set(tasks)
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    stuck: set[asyncio.Task] = set()
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=grace_s)
    for task in tasks - stuck:
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s failed while the loop ended: %r", task.get_name(), task.exception())
    if stuck:
        log.error("%d task(s) did not end %g s after their cancellation:\n%s",
                  len(stuck), grace_s, describe(stuck))
    return stuck


def run(main: Coroutine, *, grace_s: float = 30.0):
    """Runs `main` on a new event loop and returns its result, like `asyncio.run`; the
    tasks left pending are cancelled and given `grace_s`, the default executor's threads
    as long again, and what still runs then is left behind (logged) rather than waited
    on."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(cancel_and_wait(asyncio.all_tasks(loop), grace_s))
            for closing in (loop.shutdown_asyncgens(), loop.shutdown_default_executor()):
                loop.run_until_complete(asyncio.wait([loop.create_task(closing)],
                                                     timeout=grace_s))
        finally:
            asyncio.set_event_loop(None)
            loop.close()
