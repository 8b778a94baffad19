"""Known upstream warnings and log lines that say nothing to a user of this project, silenced one by one.

Each entry names the exact message and where it comes from, with the reason it is harmless; anything
else (a new upstream warning, a real problem) still reaches the terminal. `tests/test_terminal.py`
runs the smoke pipeline and fails on any third-party warning that is not listed here.

Python warnings are filtered with `warnings.filterwarnings` (message and module). Log lines are
filtered on the logger that emits them, so the filter holds whatever handlers Kedro's logging
configuration (KEDRO_LOGGING_CONFIG, conf/logging.yml) or a notebook installs: Kedro 1.7 only builds logging filters from the `logging` and `kedro.logging`
modules (others need KEDRO_LOGGING_MODULE_ALLOWLIST, read before any project code runs), so a
filter class of ours cannot be named in the logging configuration. `settings.py` calls `install()`,
which Kedro imports before it creates the configuration loader or runs a node.

A full disk or quota is reported once, as the run's one `Error:` line (`cli.py`); the records that report it on
the way there (each of Orbax's background save threads with its traceback, Kedro's failed-node line, MLflow's
store) are dropped (`DISK_FULL_LOGGERS`). `RuntimeError: Event loop is closed`, raised in a callback that Orbax's
reads or writes leave behind on an event loop already closed (a restore that failed on a corrupt checkpoint, which
the run sets aside with one warning; `upstream.loops_finish_their_tasks` prevents the ones we know of), is dropped
wherever Python reports it: asyncio's logger and `sys.unraisablehook`.

A run that a signal stopped after saving ends in the CLI's one line (`cli.py`); Kedro's failed-node record of it
(the same text again) and its runner's `--from-nodes` advice after it (the same command resumes) are dropped
(`_DropStopEcho`).

libtpu installed where no TPU is attached (the `tpu` extra, for the plan's XLA:TPU check) makes JAX probe a TPU at
its start, and libtpu print `E0000 ... unexpected worker hostname` (or `Failed to find host bounds`) before JAX falls
back to the CPU; `no_tpu_probe` leaves JAX the CPU alone there. The check still compiles for TPU topologies (libtpu's
compile-only devices do not need the TPU platform).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import PurePath

from tunix_pipeline.core.disk_full import disk_full_cause


@dataclass(frozen=True)
class KnownWarning:
    """A Python warning: its category, the exact text, and the module it is attributed to."""

    category: type[Warning]
    message: str
    module: str
    reason: str


@dataclass(frozen=True)
class KnownLogLine:
    """A log record: the logger that emits it, the file that calls the logger, the exact message."""

    logger: str
    path: str  # the end of the calling file's path, e.g. "tunix/models/safetensors_loader.py"
    message: str
    reason: str
    prefix: bool = False  # the message only starts with `message`

    def matches(self, message: str) -> bool:
        return message.startswith(self.message) if self.prefix else message == self.message


WARNINGS = (
    KnownWarning(
        UserWarning,
        "register_new_resolver() is deprecated and will be removed in a future release.\n"
        "Use register_resolver() instead.\n"
        "See https://github.com/hydra-ecosystem/omegaconf/issues/426 for migration instructions.\n",
        "kedro.config.omegaconf_config",
        "Kedro 1.7's own config loader still calls OmegaConf's old resolver API; the resolvers work (omegaconf 2.4)",
    ),
    KnownWarning(
        UserWarning,
        "The specified dataset source can be interpreted in multiple ways: LocalArtifactDatasetSource, "
        "LocalArtifactDatasetSource. MLflow will assume that this is a LocalArtifactDatasetSource source.",
        "mlflow.data.dataset_source_registry",
        "MLflow registers its local-file dataset source for two URI schemes; both candidates are the same class",
    ),
)

LOG_LINES = (
    KnownLogLine(
        "transformers",
        "transformers/__init__.py",
        "PyTorch was not found. Models won't be available and only tokenizers, configuration and file/data "
        "utilities can be used.",
        "the project runs models in JAX and uses transformers only for tokenizers and configs (torch is optional)",
    ),
    KnownLogLine(
        "absl",
        "tunix/models/safetensors_loader.py",
        "Optimized mode is faster and recommended if possible.",
        "Tunix's loader is not used for weights: ours loads them onto the mesh shards (models/loading.py)",
    ),
    *(
        KnownLogLine(
            "absl",
            "tunix/sft/utils.py",
            f"Skipping non-TPU device: {platform}. You might be missing jax[tpu] dependency.",
            "Tunix's TPU memory probe, asked about a CPU or GPU device; we log device memory where JAX reports it",
        )
        for platform in ("cpu", "gpu")
    ),
    KnownLogLine(
        "kedro.validation.parameter_validator",
        "kedro/validation/parameter_validator.py",
        "Parameter '",
        "pydantic's multi-line report of a bad parameter; the run stops with it in one line (config/validation.py)",
        prefix=True,
    ),
)

# the loggers that report a full disk before the run stops with it: Orbax's async save threads (absl), asyncio's
# tasks and callbacks, Kedro's failed node, MLflow's SQLite store (marking the failed run on the same full volume)
DISK_FULL_LOGGERS = ("absl", "asyncio", "kedro.pipeline.node", "mlflow.store.db.utils")


class _DropDiskFull(logging.Filter):
    """Drops an error record whose exception or message is a full disk or quota; keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return disk_full_cause(exc) is None and disk_full_cause(Exception(record.getMessage())) is None


STOP_LOGGERS = ("kedro.pipeline.node", "kedro.runner.sequential_runner", "kedro.runner.thread_runner",
                "kedro.runner.parallel_runner")
_STOP_LINE = re.compile(r"^(SIGTERM|SIGINT): saved a checkpoint at step \d+ in ", re.M)  # `TrainingInterrupted`'s


class _DropStopEcho(logging.Filter):
    """Drops Kedro's record of a node a stop signal ended, and the runner's advice on resuming that follows it."""

    stopping = False  # for the process: the node's record comes first, the runner's after it

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and "failed with error" in message and _STOP_LINE.search(message):
            _DropStopEcho.stopping = True
            return False
        if _DropStopEcho.stopping and record.name.startswith("kedro.runner") and "have not run" in message:
            _DropStopEcho.stopping = False
            return False
        return True


def _late_callback(exc: BaseException | None) -> bool:
    """A callback that found its event loop already closed: nothing waits for its result any more."""
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


class _DropLateCallbacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _late_callback(record.exc_info[1]))


def _unraisable_hook(report) -> None:
    if not _late_callback(report.exc_value):
        _unraisable_hook.previous(report)


class _DropKnown(logging.Filter):
    """Drops the records of `lines` (all from one logger); keeps every other record."""

    def __init__(self, lines: tuple[KnownLogLine, ...]):
        super().__init__()
        self.lines = lines

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line.matches(message) and _emitted_from(record, line.path) for line in self.lines)


def _emitted_from(record: logging.LogRecord, path: str) -> bool:
    """Whether `path` logged the record: its pathname, or a caller on the stack (absl's records name absl's file)."""
    if PurePath(record.pathname).as_posix().endswith("/" + path):
        return True
    frame = sys._getframe()
    while frame is not None:
        if PurePath(frame.f_code.co_filename).as_posix().endswith("/" + path):
            return True
        frame = frame.f_back
    return False


GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (as `jax._src.hardware_utils` finds them)
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def no_tpu_probe() -> None:
    """JAX_PLATFORMS=cpu where libtpu is installed but neither a TPU chip nor a JAX GPU plugin is here (a user's own
    JAX_PLATFORMS stands)."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if any(importlib.util.find_spec(name) is not None for name in GPU_PLUGINS):
        return
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if open(vendor).read().strip() == GOOGLE_PCI_VENDOR:
                return
        except OSError:
            continue
    os.environ["JAX_PLATFORMS"] = "cpu"


def install() -> None:
    """Adds the filters above (once per process; calling again changes nothing)."""
    no_tpu_probe()
    for known in WARNINGS:
        warnings.filterwarnings(
            "ignore", message=re.escape(known.message) + r"\Z", category=known.category,
            module=re.escape(known.module) + r"\Z",
        )
    for name in sorted({line.logger for line in LOG_LINES}):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(tuple(line for line in LOG_LINES if line.logger == name)))
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropLateCallbacks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DropLateCallbacks())
    if sys.unraisablehook is not _unraisable_hook:
        _unraisable_hook.previous = sys.unraisablehook
        sys.unraisablehook = _unraisable_hook
    for name in DISK_FULL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDiskFull) for f in logger.filters):
            logger.addFilter(_DropDiskFull())
    for name in STOP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropStopEcho) for f in logger.filters):
            logger.addFilter(_DropStopEcho())
