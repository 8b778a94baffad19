"""Process-level JAX set-up that must happen before JAX picks its devices."""

from __future__ import annotations

import os

FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def configure_host_devices(count: int) -> None:
    """Expose `count` CPU devices (a fake mesh when there is no accelerator).

    Only the CPU platform reads the flag, so it is harmless on GPU and TPU; an
    explicit flag in XLA_FLAGS wins. Has no effect once JAX has initialised its
    backends, which is why the project hook calls it before any node runs.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and FAKE_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FAKE_DEVICES_FLAG}={count}".strip()


def initialize_distributed(setting) -> None:
    """One JAX process per host: `jax.distributed.initialize`, before any device is used.

    "off": a single process; "auto": JAX finds the cluster (TPU pods, SLURM,
    ...); or explicit coordinator address, process count and id.
    """
    import jax

    if setting == "off" or jax.distributed.is_initialized():
        return
    # CPU processes need a collectives backend of their own; accelerators ignore this
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if setting == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=setting.coordinator_address,
            num_processes=setting.num_processes,
            process_id=setting.process_id,
        )
