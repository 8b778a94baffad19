"""Orbax closes its event loop with reads still in flight: what we change so that a failed restore leaves no
callbacks into a closed loop, and no read that never finishes holds the run (`loops_finish_their_tasks`, re-exported
as `upstream.loops_finish_their_tasks`)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time

from orbax.checkpoint._src import asyncio_utils

log = logging.getLogger(__name__)

# One save or restore of Orbax's (a large model to or from a bucket takes minutes); past it, it fails with a
# `TimeoutError`, which a restore treats as it treats a corrupt checkpoint (set aside for the one before)
IO_SECONDS = 1800.0
# Cancelled reads still running after this never finish (measured: 1 of 13 restores of a truncated checkpoint left
# such a read, which waited 15 minutes until killed); the others finish in well under a second
LEFTOVER_SECONDS = 10.0


def loops_finish_their_tasks() -> None:
    """Orbax's `run_sync` (its saves and restores) runs a coroutine on a fresh event loop and closes the loop as soon as
    the coroutine returns or raises. When one read of a `gather` fails (a corrupt checkpoint, set aside for the one
    before) the others are still in flight, and each, finishing, calls back into the closed loop: a `RuntimeError:
    Event loop is closed` traceback apiece. Here the loop first lets its leftover tasks finish (`_finish_leftovers`)
    and is closed only once it has been idle a while (`_retire`): a TensorStore read left behind may still finish on
    its own thread and call back. Every wait is bounded: the coroutine by `IO_SECONDS`, its leftovers by
    `LEFTOVER_SECONDS`. Once per process; nothing where Orbax has no such function."""
    original = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
    if original is None or getattr(original, "finishes_tasks", False):
        return

    def run_sync_via_new_loop(coro):
        loop = asyncio.new_event_loop()
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(_within(coro, IO_SECONDS))
        finally:
            try:
                _finish_leftovers(loop)
            finally:
                asyncio.set_event_loop(None)
                _retire(loop)

    run_sync_via_new_loop.finishes_tasks = True
    asyncio_utils._run_sync_via_new_loop = run_sync_via_new_loop
    atexit.register(_close_retired_loops)


async def _within(coro, seconds: float):
    """`coro`'s result, or a `TimeoutError` once `seconds` have passed (its task cancelled, not awaited: a read that
    ignores the cancellation would hold the wait again)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        raise TimeoutError(f"an Orbax checkpoint read or write did not finish within {seconds:.0f} s")
    return task.result()


def _finish_leftovers(loop) -> None:
    """Runs the loop until its leftover tasks are done, for at most `LEFTOVER_SECONDS`. They are not cancelled, as
    `asyncio.run` would: cancelling a TensorStore read whose result is being delivered deadlocks (the cancel waits,
    holding the GIL, for TensorStore's thread to finish delivering, which waits for the GIL), and a leftover read
    finishes in well under a second."""
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    except RuntimeError:  # another thread's tasks changed the set under it: leave them, as Orbax does
        return
    if not pending:
        return
    _, left = loop.run_until_complete(asyncio.wait(pending, timeout=LEFTOVER_SECONDS))
    if left:
        log.warning("%d checkpoint reads or writes had not finished %.0f s after their restore or save ended; left "
                    "them behind and went on", len(left), LEFTOVER_SECONDS)
        loop.set_exception_handler(lambda *_: None)  # they die with the loop: said once above, not once each


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
