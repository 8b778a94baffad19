"""Which process this is, and what the processes of a multi-host run do together: wait for each other, gather
an array onto the host, leave a file to process 0 alone (with one process, each is a plain call). Below `paths`
and `runtime`, which both use them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils

from tunix_pipeline.core.errors import UserError

T = TypeVar("T")


def is_main_process() -> bool:
    """Process 0: the one that logs to MLflow and writes the run's own (non-Orbax) files."""
    return jax.process_index() == 0


# The longest one process may work alone while the others wait for it (process 0 writing a history or an export)
BARRIER_SECONDS = 1800.0
_barriers: Counter = Counter()  # calls per barrier name: each wait gets its own key, the same on every process


class ProcessesOutOfStep(UserError, RuntimeError):
    """A multi-host barrier timed out: another process is stuck or gone."""


def barrier(name: str, seconds: float | None = None) -> None:
    """Every process waits here until all have arrived, at most `seconds` (`BARRIER_SECONDS`); a no-op with one
    process."""
    if jax.process_count() == 1:
        return

    client = distributed.global_state.client
    if client is None:  # processes JAX did not start through jax.distributed: its collective
        multihost_utils.sync_global_devices(name)
        return
    seconds = BARRIER_SECONDS if seconds is None else seconds
    _barriers[name] += 1
    try:
        client.wait_at_barrier(f"tunix_pipeline/{name}/{_barriers[name]}", int(seconds * 1000))
    except Exception as err:  # jaxlib's JaxRuntimeError: DEADLINE_EXCEEDED, or a peer that failed
        raise ProcessesOutOfStep(
            f"waited {seconds:.0f} s at '{name}' for the other processes of this multi-host run, then stopped: one of "
            f"them is stuck or has ended (its log says why): {str(err).splitlines()[0] if str(err) else err!r}"
        ) from None


def host_array(x) -> np.ndarray:
    """The whole value of `x` as numpy on this host, also when its shards live on other processes' devices.

    `np.asarray` refuses an array that spans other processes' devices; such an array is gathered
    (every process receives all of it). That is a collective: in a multi-host run every process
    must call this for the same arrays in the same order.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def on_main_process(name: str, write: Callable[[], T]) -> T | None:
    """`write()` on process 0 only (files the processes would otherwise race on); None elsewhere.

    Every process leaves together, and all fail when process 0 fails, so none goes on alone.
    """
    if jax.process_count() == 1:
        return write()

    result, error = None, None
    if is_main_process():
        try:
            result = write()
        except Exception as err:  # re-raised below, once the other processes know
            error = err
    failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{name}: failed on process 0; its log says why")
    return result
