"""Orbax closes its event loop with reads still in flight: what we change so that a failed restore leaves no
callbacks into a closed loop (`loops_finish_their_tasks`, re-exported as `upstream.loops_finish_their_tasks`)."""

from __future__ import annotations

import asyncio
import atexit
import threading
import time


def loops_finish_their_tasks() -> None:
    """Orbax's `run_sync` (its saves and restores) runs a coroutine on a fresh event loop and closes the loop as soon as
    the coroutine returns or raises. When one read of a `gather` fails (a corrupt checkpoint, set aside for the one
    before) the others are still in flight, and each, finishing, calls back into the closed loop: a `RuntimeError:
    Event loop is closed` traceback apiece. Here the loop first cancels and awaits its leftover tasks, as
    `asyncio.run` does, and is closed only once it has been idle a while (`_retire`): a cancelled TensorStore read
    may still finish on its own thread and call back. Once per process; nothing where Orbax has no such function."""
    from orbax.checkpoint._src import asyncio_utils

    original = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
    if original is None or getattr(original, "finishes_tasks", False):
        return

    def run_sync_via_new_loop(coro):
        loop = asyncio.new_event_loop()
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(coro)
        finally:
            try:
                _finish_leftovers(loop)
            finally:
                asyncio.set_event_loop(None)
                _retire(loop)

    run_sync_via_new_loop.finishes_tasks = True
    asyncio_utils._run_sync_via_new_loop = run_sync_via_new_loop
    atexit.register(_close_retired_loops)


def _finish_leftovers(loop) -> None:
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    except RuntimeError:  # another thread's tasks changed the set under it: leave them, as Orbax does
        return
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


_RETIRED_LOOPS: list = []  # (when, loop) of finished `run_sync` loops, not yet closed
_RETIRED_LOCK = threading.Lock()  # Orbax's async saves call `run_sync` from threads of their own
RETIRED_LOOP_SECONDS = 30.0  # far longer than a read in flight takes to finish


def _retire(loop) -> None:
    """Closes the loops that finished more than `RETIRED_LOOP_SECONDS` ago and keeps `loop` open until then (all of
    them at exit): a late callback into an open loop that no longer runs is queued and dropped with it."""
    now = time.monotonic()
    with _RETIRED_LOCK:
        while _RETIRED_LOOPS and now - _RETIRED_LOOPS[0][0] > RETIRED_LOOP_SECONDS:
            _RETIRED_LOOPS.pop(0)[1].close()
        _RETIRED_LOOPS.append((now, loop))


def _close_retired_loops() -> None:
    with _RETIRED_LOCK:
        while _RETIRED_LOOPS:
            _RETIRED_LOOPS.pop(0)[1].close()
