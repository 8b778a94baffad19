"""One writer per output root: a run holds `<root>/.run.lock` (its pid, host, command and start) from before its first
node until it ends, so that a second run into the same root (a cell run twice, a second terminal) stops before it
writes anything, naming the first, instead of training into the same checkpoints and MLflow store.

A lock whose run is gone is taken over with a line saying so: on this host, when its process no longer exists (or the
pid now belongs to a newer process); on another host, which this one cannot ask, when it has not been refreshed for
`STALE_SECONDS` (the holder touches it every `REFRESH_SECONDS`). A multi-host run takes it on process 0 only.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import psutil

from tunix_pipeline.core.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
REFRESH_SECONDS = 30.0
STALE_SECONDS = 300.0  # ten refreshes missed: the holder's host is down or cut off


class OutputRootBusy(UserError, RuntimeError):
    """Another run is writing into this output root."""


class OutputLock:
    """A held lock, refreshed until `release` (also at exit: a run ended by an exception Kedro does not hand its hooks,
    such as a second Ctrl-C)."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder = path, holder
        self._released = threading.Event()
        threading.Thread(target=self._refresh, name="output-root-lock", daemon=True).start()
        atexit.register(self.release)

    def _refresh(self) -> None:
        while not self._released.wait(REFRESH_SECONDS):
            try:
                os.utime(self.path)
            except OSError:  # the folder went away: nothing to keep
                return

    def release(self) -> None:
        if self._released.is_set():
            return
        self._released.set()
        atexit.unregister(self.release)
        if _read(self.path) == self.holder:  # never remove a lock another run has taken over since
            self.path.unlink(missing_ok=True)


def acquire(root: Path, command: str) -> OutputLock:
    """Holds `root`'s lock for this process, or raises `OutputRootBusy` naming the run that holds it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
    while True:
        try:
            with open(path, "x") as f:
                try:
                    json.dump(me, f)
                    f.flush()
                except BaseException:  # a full disk: no empty lock left for the next run to wait on
                    path.unlink(missing_ok=True)
                    raise
            return OutputLock(path, me)
        except FileExistsError:
            pass
        holder = _read(path)
        gone = _why_gone(holder, path)
        if gone is None:
            raise OutputRootBusy(_busy_message(root, path, holder))
        if _take_over(path, holder):
            log.warning("output root %s: took over the lock of a run that is gone (%s: %s)", root, gone,
                        (holder or {}).get("command", "unknown command"))


def _read(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _why_gone(holder: dict | None, path: Path) -> str | None:
    """Why the lock's run is over, or None while it may still be running."""
    if holder is None:  # cut short while written (a kill at that instant), or written by hand
        return "an unreadable lock file" if _age(path) > REFRESH_SECONDS else None
    if holder.get("host") != socket.gethostname():
        age = _age(path)
        return f"not refreshed for {age:.0f} s" if age > STALE_SECONDS else None
    pid = holder.get("pid")
    if pid == os.getpid():  # an earlier run of this process (a notebook cell interrupted) did not let it go
        return "an earlier run of this process"
    try:
        started = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, TypeError, ValueError):
        return f"process {pid} has ended"
    except psutil.AccessDenied:
        return None
    return f"pid {pid} now belongs to a newer process" if started > holder.get("started", 0) + 1 else None


def _take_over(path: Path, holder: dict | None) -> bool:
    """Removes the lock of a run that is gone, unless another run replaced it meanwhile (then it is put back)."""
    aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another run took it over first: try again
        return False
    if _read(aside) != holder:
        os.rename(aside, path)
        return False
    aside.unlink(missing_ok=True)
    return True


def _busy_message(root: Path, path: Path, holder: dict | None) -> str:
    if holder is None:
        who = "a run whose lock file is being written"
    else:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {started}: "
               f"`{holder.get('command', 'unknown command')}`")
    return (f"output root {root} is in use by another run ({who}); wait for it to end or stop it, or give this run "
            f"another folder (--params runtime.output_root=...); if that run is gone for good, delete {path}")
