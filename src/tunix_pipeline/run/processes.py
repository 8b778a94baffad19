"""Which process this is, and what the processes of a multi-host run do together: wait for each other, gather
an array onto the host, leave a file to process 0 alone (with one process, each is a plain call). Below `paths`
and `runtime`, which both use them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def is_main_process() -> bool:
    """Process 0: the one that logs to MLflow and writes the run's own (non-Orbax) files."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def host_array(x) -> np.ndarray:
    """The whole value of `x` as numpy on this host, also when its shards live on other processes' devices.

    `np.asarray` refuses an array that spans other processes' devices; such an array is gathered
    (every process receives all of it). That is a collective: in a multi-host run every process
    must call this for the same arrays in the same order.
    """
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def on_main_process(name: str, write: Callable[[], T]) -> T | None:
    """`write()` on process 0 only (files the processes would otherwise race on); None elsewhere.

    Every process leaves together, and all fail when process 0 fails, so none goes on alone.
    """
    import jax

    if jax.process_count() == 1:
        return write()
    from jax.experimental import multihost_utils

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
