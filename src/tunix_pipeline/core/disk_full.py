"""A full disk or quota, whichever library hit it (Python, Orbax's TensorStore, safetensors, MLflow's SQLite), as
one line: the folder, the bytes it needed and had free, and the setting that moves it (`cli.py` says it)."""

import errno
import re
import shutil
from pathlib import Path

from tunix_pipeline.core.errors import UserError


class DiskFullError(UserError, OSError):
    """A folder the run writes to has no space (or quota) left; the message names it, the bytes needed and free,
    and the setting that moves it."""


# ENOSPC and EDQUOT as Python, TensorStore (Orbax's RESOURCE_EXHAUSTED), Rust (safetensors) and SQLite (MLflow) say it
_FULL = re.compile(r"No space left on device|Disk quota exceeded|os error (?:28|122)\b|os_error_code='(?:28|122)'"
                   r"|database or disk is full", re.IGNORECASE)
_QUOTA = re.compile(r"quota|os error 122\b|os_error_code='122'", re.IGNORECASE)
_WRITING = re.compile(r"Failed to write (\d+) bytes")
_PATH = re.compile(r"""["'](/[^"'\n]+)["']""")
_STEP = re.compile(r"^\d+(?:\.orbax-checkpoint-tmp.*)?$")  # a checkpoint step's folder, whole or half-written


def disk_full_cause(err: BaseException | None) -> BaseException | None:
    """The exception in `err`'s chain (causes, contexts, exception groups) that says a disk or quota is full."""
    causes = _disk_full_chain(err)
    return causes[0] if causes else None


def _disk_full_chain(err: BaseException | None) -> list[BaseException]:
    found, seen, todo = [], set(), [err]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or _FULL.search(str(exc)):
            found.append(exc)
        todo += [exc.__cause__, exc.__context__, *getattr(exc, "exceptions", ())]
    return found


def _paths(exc: BaseException) -> list[str]:
    return [p for p in (getattr(exc, "filename", None), *_PATH.findall(str(exc))) if p]


def disk_full_error(err: BaseException, params: dict | None = None) -> DiskFullError | None:
    """`err` as one line, when it is a full disk or quota (else None): the folder, the bytes it needed (the newest
    whole checkpoint's size in a checkpoint folder, else what the failed write held, where known) and had free, and
    the setting of `params` (the run's resolved parameters) that moves it."""
    causes = _disk_full_chain(err)
    if not causes:
        return None
    params = params or {}
    # the write that names its file (Orbax's, Python's), not a later one that failed for the same reason without
    # (MLflow's SQLite, marking the run failed): that one is under the output root
    cause = next((c for c in causes if _paths(c)), causes[0])
    text = str(cause)
    paths = _paths(cause)
    root = (params.get("runtime") or {}).get("output_root")
    uri = str((params.get("tracking") or {}).get("tracking_uri") or "")
    if not paths and "database or disk is full" in text and uri.startswith("sqlite:///"):
        paths = [uri.removeprefix("sqlite:///")]  # MLflow's SQLite names no file: the run's tracking database
    path = Path(paths[-1] if paths else root or ".").absolute()
    checkpoints = next((p.parent for p in (path, *path.parents) if _STEP.match(p.name)), None)
    folder = checkpoints or (path if path.is_dir() else path.parent)
    whole = _newest_step(checkpoints) if checkpoints else None
    writing = _WRITING.search(text)
    if whole is not None:
        needed = f"a checkpoint needs about {_size(_bytes_in(checkpoints / str(whole)))} (step {whole}'s size)"
    elif writing:
        needed = f"it was writing {_size(int(writing.group(1)))}"
    else:
        needed = "the size it needed is unknown"
    setting = _setting(folder, params or {})
    fix = f"point {setting} (or runtime.output_root) at" if setting != "runtime.output_root" else \
        "point runtime.output_root at"
    resume = f": it resumes from step {whole}" if whole is not None else ""
    what = "disk quota exceeded" if _QUOTA.search(text) else "no space left on device"
    return DiskFullError(
        f"{what} in {folder}: {needed}, {_size(_free(folder))} free there; free space on that volume or {fix} a "
        f"folder on a larger one, then rerun the same command{resume}")


def _newest_step(folder: Path) -> int | None:
    steps = [int(p.name) for p in folder.glob("*") if p.name.isdigit() and p.is_dir()]
    return max(steps) if steps else None


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _free(folder: Path) -> int:
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _size(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _setting(folder: Path, params: dict) -> str:
    """The folder setting (`<section>.<name>_dir`, `runtime.output_root`) whose folder holds `folder`: the deepest one."""
    found = []
    for section, values in params.items():
        for key, value in (values.items() if isinstance(values, dict) else ()):
            if key == "tracking_uri" and isinstance(value, str) and value.startswith("sqlite:///"):
                value = str(Path(value.removeprefix("sqlite:///")).parent)  # MLflow's database's folder
            if isinstance(value, str) and (key.endswith(("_dir", "_uri")) or key == "output_root") and "://" not in value:
                root = Path(value).absolute()
                if folder == root or root in folder.parents:  # the deepest; the output root before another as deep
                    found.append((len(root.parts), key == "output_root", f"{section}.{key}"))
    return max(found)[2] if found else "runtime.output_root"
