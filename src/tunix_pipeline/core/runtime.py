"""Process-level JAX set-up (before JAX picks its devices), the compiler options of train steps, host memory handed
back between stages, the device mesh and each process's share of a batch, and the check that every process of a
multi-host run shares the checkpoint folders (the processes' other joint work, barriers and the like: `processes`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from tunix_pipeline.core.errors import UserError
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.processes import barrier, is_main_process
from tunix_pipeline.stages import STAGES

if TYPE_CHECKING:  # annotations only: config sits above this package
    from tunix_pipeline.config import RuntimeParams, SftParams

log = logging.getLogger(__name__)
MESH_AXES = ("data", "fsdp", "tp")
# the batch dimension is split over every data-parallel axis
BATCH_AXES = (("data", "fsdp"),)

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


# XLA:CPU's default hands every dot to YNNPACK on its own ("individual dot") and
# then lays the backward pass out with transposing copies of each MLP activation
# gradient (slow strided loops). Letting YNNPACK fuse dots with their neighbours
# instead ran the CPU train step ~1.35x faster in benchmarks/cpu_sft.py with
# bitwise-equal results. Only XLA:CPU reads these options.
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE",
}
_supported_options: dict[str, bool] = {}


def step_compiler_options() -> dict:
    """`CPU_COMPILER_OPTIONS` when JAX runs on the CPU and this XLA accepts them, else none."""
    if jax.default_backend() != "cpu" or not CPU_COMPILER_OPTIONS:
        return {}
    key = repr(sorted(CPU_COMPILER_OPTIONS.items()))
    if key not in _supported_options:
        try:  # an XLA that does not know an option refuses to compile with it
            jax.jit(jnp.dot, compiler_options=CPU_COMPILER_OPTIONS).lower(jnp.ones((2, 2)), jnp.ones((2, 2))).compile()
            _supported_options[key] = True
        except Exception as err:  # noqa: BLE001 - any refusal means: compile without them
            log.info("XLA:CPU options %s not supported here (%s); compiling without them", CPU_COMPILER_OPTIONS, err)
            _supported_options[key] = False
    return dict(CPU_COMPILER_OPTIONS) if _supported_options[key] else {}


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)


def hand_back_host_memory() -> None:
    """Return to the system what finished work left in this process, before the next big allocation: objects in
    reference cycles (an earlier stage's model among them: Python collects cycles only at its next threshold), then,
    on glibc, the freed blocks it keeps for reuse (XLA:CPU's buffers and the compiler's are host memory). In the GSM8K
    CPU recipe's whole DAG, at GRPO's start: 3.25 GiB resident before, 2.56 after the collection, 1.31 after the trim
    (benchmarks/RESULTS.md, section 49)."""
    gc.collect()
    if hasattr(_libc, "malloc_trim"):  # glibc only (musl and macOS have none)
        _libc.malloc_trim(0)


def initialize_distributed(setting) -> None:
    """One JAX process per host: `jax.distributed.initialize`, before any device is used.

    "off": a single process; "auto": JAX finds the cluster (TPU pods, SLURM,
    ...); or explicit coordinator address, process count and id.
    """
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


class FolderNotShared(UserError, RuntimeError):
    """A folder that every process of a multi-host run must share is not the same folder on all of them."""


# the folders Orbax writes from every process together, by the node that writes them
ORBAX_FOLDERS = {stage.train_node: stage.checkpoint_setting for stage in STAGES}


def orbax_folders(params: dict, node_names: Iterable[str]) -> dict[str, str]:
    """{setting: folder} of the checkpoint folders these nodes write (a stage's only when it is enabled)."""
    names = set(node_names)
    folders = {}
    for node, setting in ORBAX_FOLDERS.items():
        section, key = setting.split(".")
        if node in names and params.get(section, {}).get("enabled", True):
            folders[setting] = str(params[section][key])
    return folders


def check_shared_folders(folders: dict[str, str], timeout_s: float) -> None:
    """In a multi-host run, that each folder ({setting: path or URI}) is one folder every process sees.

    Orbax writes a checkpoint from all processes into one folder; on a folder that is not shared it
    waits ten minutes for the others' files and then fails without naming the setting. Here process 0
    writes a marker holding a nonce of this launch into each folder (so a marker left by an earlier
    launch cannot pass), and the others look for it for up to `timeout_s`; then every process knows
    every result, and all stop with the same message when one folder is not shared. A collective:
    every process calls it with its own values of the same settings. A no-op with one process.
    """
    if not folders:
        return

    if jax.process_count() == 1:
        return

    settings = sorted(folders)
    paths = [storage_path(folders[setting], setting) for setting in settings]
    nonce = bytes(multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(16), np.uint8))).hex()
    markers = [path / f".shared-check-{nonce}" for path in paths]
    found = np.zeros(len(settings), np.int32)  # per folder: 1 when this process sees the marker
    problems = _write_markers(markers, nonce, settings, found) if is_main_process() else {}
    barrier("shared-folders-written")
    if not is_main_process():
        deadline = time.monotonic() + timeout_s
        while True:
            for i, marker in enumerate(markers):
                found[i] = found[i] or _holds(marker, nonce)
            if found.all() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    everyone = np.asarray(multihost_utils.process_allgather(found))  # (processes, folders)
    where = [_allgather_text(str(path)) for path in paths]  # per folder, each process's own path
    if is_main_process():
        for i, marker in enumerate(markers):
            if found[i]:
                with contextlib.suppress(Exception):  # a file left behind is harmless; leaving here would strand
                    marker.unlink(missing_ok=True)    # the other processes at the barrier
    barrier("shared-folders-checked")  # every process leaves once the files are gone
    failed = [i for i in range(len(settings)) if not everyone[:, i].all()]
    if not failed:
        log.info("%s: one folder on all %d processes", ", ".join(settings), len(everyone))
        return
    raise _not_shared(settings, failed, everyone, where, problems, timeout_s)


def _not_shared(settings: list[str], failed: list[int], everyone: np.ndarray, where: list[list[str]],
                problems: dict[str, str], timeout_s: float) -> FolderNotShared:
    """The error naming each failed folder setting, where each process sees it, and what went wrong."""
    lines = []
    for i in failed:
        setting = settings[i]
        seen = ", ".join(f"process {p}: {path}" for p, path in enumerate(where[i]))
        missing = [p for p in range(len(everyone)) if not everyone[p, i]]
        if 0 in missing:
            lines.append(f"{setting} ({seen}): {problems.get(setting, 'process 0 cannot write in it (its log says why)')}")
        else:
            lines.append(f"{setting} ({seen}): process{'es' if len(missing) > 1 else ''} "
                         f"{', '.join(map(str, missing))} did not see the file that process 0 wrote there within "
                         f"{timeout_s:g} s")
    return FolderNotShared(
        "these checkpoint folders are not one folder shared by every process of this multi-host run: "
        + "; ".join(lines) + ". Orbax writes each checkpoint from all processes together, so set them to a folder "
        "that every worker mounts at the same path (an NFS / Filestore share) or to a gs://bucket/path, e.g. "
        + ", ".join(f"--params {settings[i]}=/mnt/shared/run/{settings[i].split('.')[0]}_checkpoints" for i in failed)
        + ". A shared filesystem that shows new files late (NFS attribute caching) needs a longer "
        "runtime.shared_folder_timeout_s."
    )


def _write_markers(markers: list, nonce: str, settings: list[str], found: np.ndarray) -> dict[str, str]:
    """Process 0 writes each marker, marking it found; {setting: why not} for those it cannot write."""
    problems = {}
    for i, marker in enumerate(markers):
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(nonce)
            found[i] = 1
        except Exception as err:  # any kind (an object store's too): raised later, once every process knows
            problems[settings[i]] = f"process 0 cannot write in it ({type(err).__name__}: {err})"
    return problems


def _holds(marker, nonce: str) -> bool:
    """Whether `marker` exists here with `nonce` in it. The folder is listed first: on NFS, listing a
    directory revalidates its cached attributes, where a lookup by name may keep answering from a
    cached "no such file" for a while."""
    try:
        return marker.name in {p.name for p in marker.parent.iterdir()} and marker.read_text() == nonce
    except Exception:  # the folder does not exist here (yet), or the store did not answer: look again
        return False


def _allgather_text(text: str, size: int = 4096) -> list[str]:
    """Every process's `text` (UTF-8, at most `size` bytes), in process order. A collective."""
    data = text.encode()[:size]
    buffer = np.zeros(size, np.uint8)  # a fixed shape on every process, padded with NULs (no path holds one)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered]


class MeshError(UserError, ValueError):
    """A mesh or batch size that does not fit the devices."""


# ---------------------------------------------------------------- mesh
def make_mesh(runtime: RuntimeParams, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tp) mesh over all devices; every axis exists (Tunix's shardings name fsdp and tp)."""
    devices = devices if devices is not None else jax.devices()
    if runtime.mesh == "auto":
        shape = {"data": 1, "fsdp": len(devices), "tp": 1}
    else:
        shape = {axis: runtime.mesh.get(axis, 1) for axis in MESH_AXES}
    size = int(np.prod(list(shape.values())))
    if size != len(devices):
        # a pod slice seen from one worker: its processes were not joined into one JAX runtime
        pod = size > len(devices) and jax.process_count() == 1
        raise MeshError(
            f"runtime.mesh {shape} needs {size} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); set `runtime.mesh: auto` or sizes whose product is {len(devices)}"
            + ("; on a multi-host slice start every worker with `--params runtime.distributed=auto`" if pod else "")
        )
    return jax.make_mesh(
        tuple(shape.values()), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
    )


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def global_batch_size(sft: SftParams, mesh: jax.sharding.Mesh) -> int:
    """Rows per micro-batch: per-device batch times the data-parallel devices (tp devices share rows)."""
    return sft.per_device_batch_size * data_parallel_size(mesh)


def process_rows(mesh: jax.sharding.Mesh, batch_size: int) -> slice:
    """The rows of each global batch that this process feeds to its own devices."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*BATCH_AXES))
    spans = sorted(
        {(s[0].start or 0, s[0].stop or batch_size) for s in sharding.addressable_devices_indices_map((batch_size,)).values()}
    )
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise MeshError(f"this process's devices hold non-contiguous rows {spans} of the batch")
    return slice(start, stop)


def shard_rows(batch: dict, mesh: jax.sharding.Mesh) -> dict:
    """This process's rows of a global batch (`process_rows`) as global arrays split over the data axes.

    Not Tunix's `shard_input`: it checks the divisibility on the process's own rows, and where they
    do not divide over the data-parallel devices (2 rows a process, 4 devices) it replicates them,
    so each process computes on its own rows as if they were the whole batch.
    """
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*BATCH_AXES))
    return {k: v if isinstance(v, jax.Array) and not v.is_fully_addressable  # already global
            else jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def without_batch_axes(x):
    """`x` whole on each data-parallel device (its `BATCH_AXES` splits undone, its tensor-parallel ones kept)."""
    return jax.device_put(x, whole_over_batch(x)) if split_over_batch(x) else x


def split_over_batch(x) -> bool:
    """Is `x` (an array or a ShapeDtypeStruct) split over a data-parallel axis (`BATCH_AXES`)?"""
    return isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) and whole_over_batch(x) != x.sharding


def whole_over_batch(x) -> jax.sharding.NamedSharding:
    """`x`'s sharding with its splits over `BATCH_AXES` dropped."""
    def kept(axis):
        names = tuple(n for n in ((axis,) if isinstance(axis, str) else (axis or ())) if n not in BATCH_AXES[0])
        return names if len(names) > 1 else (names[0] if names else None)

    return jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(*(kept(a) for a in x.sharding.spec)))
