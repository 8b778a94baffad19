"""Output locations: a local folder, or an object-store URI such as `gs://bucket/run`.

Checkpoints, their histories, the run record and the sessions ledger go through
`etils.epath`, the path type Orbax itself uses: a local path is made absolute, a URI
is passed on as it is (`Path("gs://b/run").resolve()` would make it `<cwd>/gs:/b/run`).
Orbax writes a `gs://` checkpoint's arrays with TensorStore, its other files with epath
(which reaches Cloud Storage through fsspec's `gcsfs`), and asks `google-cloud-storage`
about the bucket: the project's `gcs` extra installs both.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from etils import epath

from tunix_pipeline.core.errors import UserError

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# what epath reaches (through fsspec), with the package each needs
_SCHEMES = {"gs": ("gcs", "gcsfs and google-cloud-storage"), "s3": ("s3", "s3fs"), "az": ("az", "adlfs")}


def is_uri(value: str | os.PathLike) -> bool:
    return _URI.match(os.fspath(value)) is not None


def location_problem(text: str) -> str | None:
    """Why `text` cannot be an output location on this machine (a URI that epath does not reach, or whose
    filesystem package is not installed), or None. The settings' own type (`config.base.Location`) asks this once,
    when their section validates."""
    match = _URI.match(text)
    if match is None:
        return None
    scheme = match.group(1)
    if scheme not in _SCHEMES:
        return f"{text} is a {scheme}:// URI; use a local folder or one of " + ", ".join(f"{s}://" for s in _SCHEMES)
    protocol, packages = _SCHEMES[scheme]
    try:
        import fsspec  # optional: the gcs extra (gcsfs) for gs:// outputs

        fsspec.get_filesystem_class(protocol)
        if scheme == "gs":
            import google.cloud.storage  # noqa: F401  optional (the gcs extra): Orbax asks it about the bucket
    except ImportError:
        return (f"{text} needs {packages} to read and write {scheme}:// ("
                + ("install the project's gcs extra: pip install 'tunix_pipeline[gcs]')" if scheme == "gs"
                   else "pip install them)"))
    return None


def storage_path(value: str | os.PathLike, setting: str = "path") -> epath.Path:
    """`value` as an epath: a local path absolute, a URI untouched. A setting's value was checked when its section
    validated; a value from elsewhere (a stage's result, the ledger) is checked here, named `setting`."""
    text = os.fspath(value)
    if not is_uri(text):
        return epath.Path(Path(text).resolve())
    if (problem := location_problem(text)) is not None:
        raise UserError(f"{setting}: {problem}")
    return epath.Path(text)


@contextmanager
def local_folder(destination: str | os.PathLike, setting: str = "path"):
    """A local folder to write the flat folder `destination` (a model) into: itself when local;
    for a URI (where folders cannot be renamed into place), a temporary folder copied over it when
    the block succeeds: the old `config.json` and stale files removed first, the new `config.json`
    written last, so a reader that finds a config finds the files that go with it. Only process 0
    uploads: in a multi-host run the other processes' folders are empty."""
    target = storage_path(destination, setting)
    if not is_uri(target):
        yield Path(target)
        return
    with tempfile.TemporaryDirectory(prefix="upload.") as tmp:
        local = Path(tmp) / target.name
        yield local
        from tunix_pipeline.core.processes import is_main_process  # start-up: loads JAX (see core/__init__.py)

        if not is_main_process():  # process 0 alone writes the model (processes.on_main_process); others upload nothing
            return
        names = sorted((p.name for p in local.iterdir()), key=lambda name: name == "config.json")
        for old in target.iterdir() if target.exists() else ():
            if old.name == "config.json" or old.name not in names:
                old.unlink()
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            with (local / name).open("rb") as src, (target / name).open("wb") as out:
                shutil.copyfileobj(src, out)


@contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """A temporary folder beside `out`, moved into its place only if the block succeeds:
    a failure never leaves a half-written model."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
