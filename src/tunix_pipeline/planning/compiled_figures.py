"""What XLA said of a program, kept by the program's own text: a plan compiled again (the plan pipeline, then
the sft preflight of the run it planned; a second plan after a change elsewhere) reads the figures instead of
compiling the same program for minutes.

The key is everything the compiled figures depend on: the lowered StableHLO (shapes, dtypes, shardings, the
mesh, donations), the compiler options, the devices (platform, kind, count, coordinates) and the versions of
JAX, jaxlib and libtpu. The same key is the same compile, so a figure read back is the figure XLA would
give again; a program XLA:TPU refuses for memory is kept as that refusal. Other failures are not kept.

The figures live beside JAX's persistent compilation cache, in `<jax_compilation_cache_dir>/xla-figures/`,
when one is set (JAX_COMPILATION_CACHE_DIR), and otherwise in the machine's temporary folder
(`tunix-pipeline-xla-figures/`): a few hundred bytes a program, so the sft preflight of `kedro run` after
`kedro run --pipelines=plan` in the same session reads back what the plan compiled (minutes of XLA:TPU) without a
cache of executables on the session's disk. A TPU topology's programs compiled on compile-only devices cannot be
read back from JAX's own cache (`xla._unpersisted`), their figures can. An unreadable entry is compiled again; a
folder that cannot be written keeps them for the process.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import jax
import jaxlib

_IN_PROCESS: dict[str, dict] = {}
REFUSED = "Ran out of memory"  # XLA:TPU's refusal of a program over the chip's memory: as stable as a figure


class Refused(RuntimeError):
    """XLA:TPU's refusal read back (the message as XLA gave it)."""


def key(lowered, compiler_options: dict | None, devices) -> str:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    head = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "libtpu": version("libtpu"),
        "options": sorted((compiler_options or {}).items()),
        "devices": [[d.platform, d.device_kind, str(getattr(d, "coords", None)),
                     getattr(d, "core_on_chip", None)] for d in devices],
    }
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode())
    digest.update(lowered.as_text().encode())
    return digest.hexdigest()


def method(how: str, *parts: dict) -> str:
    """`how` the figures were had, saying when every compile was read back rather than run."""
    return f"{how}; read back from the same program's compile" if all(p.get("compiled_before") for p in parts) else how


def _folder() -> Path:
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / "xla-figures" if root else Path(tempfile.gettempdir()) / "tunix-pipeline-xla-figures"


def read(entry: str) -> dict | None:
    """The figures kept for `entry`; raises `Refused` for a kept refusal; None when nothing (readable) is kept."""
    figures = _IN_PROCESS.get(entry)
    folder = _folder()
    if figures is None:
        try:
            figures = json.loads((folder / f"{entry}.json").read_text())
        except (OSError, ValueError):
            return None
    if figures is None:
        return None
    if "refused" in figures:
        raise Refused(figures["refused"])
    return dict(figures)


def write(entry: str, figures: dict) -> None:
    """Keep `figures` (or `{"refused": message}`) for `entry`; a folder that cannot be written keeps it in memory."""
    _IN_PROCESS[entry] = dict(figures)
    folder = _folder()
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(figures, f)
        os.replace(tmp, folder / f"{entry}.json")  # whole or absent: another process may read it now
    except OSError:  # a full disk, a read-only cache: the figures stay in this process
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
