"""A full disk: the run stops with one `Error:` line (the folder, the bytes needed and free, the setting to change),
the newest whole checkpoint survives, and once there is space the same command resumes from it and finishes.

The small volume is a 6 MB tmpfs mounted in a user and mount namespace of its own (`unshare -rm`, no root needed
where the kernel allows unprivileged user namespaces); it is grown in place (`mount -o remount,size=...`) for the
second run, the files the first one left untouched.
"""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tunix_pipeline.core.disk_full import DiskFullError, disk_full_cause, disk_full_error

KEDRO = str(Path(sys.executable).with_name("kedro"))
# to SFT's end only (the shortest run that writes checkpoints): step 10's checkpoint fits in 6 MB beside the
# base model and mlflow.db, step 20's does not
PARAMS = "sft.max_steps=20,sft.checkpoint_every=10,sft.keep_checkpoints=3"
SCRIPT = """
mount -t tmpfs -o size=6m tmpfs "$VOL" || exit 90
"$KEDRO" run --pipelines=smoke --to-nodes=train_sft --params "runtime.output_root=$VOL,$PARAMS" > "$LOGS/full.log" 2>&1
echo $? > "$LOGS/full.rc"
ls "$VOL/06_models/sft_checkpoints" > "$LOGS/full.ls" 2>&1
mount -o remount,size=64m tmpfs "$VOL" || exit 91
"$KEDRO" run --pipelines=smoke --to-nodes=train_sft --params "runtime.output_root=$VOL,$PARAMS" > "$LOGS/resumed.log" 2>&1
echo $? > "$LOGS/resumed.rc"
ls "$VOL/06_models/sft_checkpoints" > "$LOGS/resumed.ls" 2>&1
"""


def _namespace_mounts(tmp_path) -> str | None:
    """Why a tmpfs cannot be mounted in a namespace of our own here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux) on this machine"
    probe = tmp_path / "probe"
    probe.mkdir()
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return ("this kernel refuses an unprivileged user+mount namespace with a tmpfs "
                f"(`unshare -rm mount -t tmpfs`: {result.stderr.strip()})")
    return None


@pytest.mark.slow
def test_a_full_disk_stops_in_one_line_and_the_same_command_resumes(project, tmp_path):
    if (why := _namespace_mounts(tmp_path)) is not None:
        pytest.skip(why)
    vol, logs = tmp_path / "vol", tmp_path / "logs"
    vol.mkdir()
    logs.mkdir()
    env = {**os.environ, "VOL": str(vol), "LOGS": str(logs), "KEDRO": KEDRO, "PARAMS": PARAMS, "COLUMNS": "200"}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", SCRIPT], cwd=project, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

    full = (logs / "full.log").read_text()
    errors = [line for line in full.splitlines() if line.startswith("Error:")]
    assert (logs / "full.rc").read_text().strip() == "1", full[-3000:]
    assert len(errors) == 1 and "Traceback" not in full, full[-6000:]
    error = errors[0]
    ckpt_dir = vol / "06_models" / "sft_checkpoints"
    assert "no space left on device in " + str(vol) in error and " free there" in error, error
    assert "runtime.output_root" in error and "rerun the same command" in error, error
    left = (logs / "full.ls").read_text().split()
    whole = sorted(int(name) for name in left if name.isdigit())
    if f"in {ckpt_dir}:" in error:  # a checkpoint's save filled the disk (measured: step 20's)
        assert "sft.checkpoint_dir" in error and "a checkpoint needs about" in error, error
        assert whole and f"it resumes from step {whole[-1]}" in error, (error, left)

    resumed = (logs / "resumed.log").read_text()
    assert (logs / "resumed.rc").read_text().strip() == "0", resumed[-6000:]
    assert "Traceback" not in resumed, resumed[-6000:]
    assert not [line for line in resumed.splitlines() if line.startswith("Error:")], resumed[-6000:]
    if whole:
        assert f"resuming SFT from checkpoint step {whole[-1]}" in " ".join(resumed.split()), resumed[-6000:]
    after = (logs / "resumed.ls").read_text().split()
    assert "20" in after and not [name for name in after if "tmp" in name], after  # the half-written step is gone


def test_full_disks_as_each_library_says_it(tmp_path):
    """ENOSPC and EDQUOT from Python, Orbax (TensorStore's RESOURCE_EXHAUSTED), safetensors and MLflow's SQLite are
    recognised through the exception chain; an out-of-memory RESOURCE_EXHAUSTED is not."""
    ckpt = tmp_path / "out" / "06_models" / "sft_checkpoints"
    (ckpt / "10" / "model_params").mkdir(parents=True)
    (ckpt / "10" / "model_params" / "data").write_bytes(b"x" * 2500)
    (ckpt / "20.orbax-checkpoint-tmp").mkdir()
    params = {"runtime": {"output_root": str(tmp_path / "out")},
              "sft": {"checkpoint_dir": str(ckpt), "checkpoint_every": 10}}

    orbax = ValueError(f'RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database at local file "{ckpt}/20.orbax-'
                       f'checkpoint-tmp/model_params.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: "{ckpt}/20'
                       '.orbax-checkpoint-tmp/d/9b": Failed to write 44033 bytes to file 7: No space left on device '
                       "[os_error_code='28']")
    try:
        try:
            raise orbax
        except ValueError as inner:
            raise RuntimeError("Event loop stopped before Future completed.") from inner
    except RuntimeError as outer:
        err = disk_full_error(outer, params)
    assert isinstance(err, DiskFullError) and isinstance(err, OSError)
    text = str(err)
    assert text.startswith(f"no space left on device in {ckpt}: a checkpoint needs about 2.5 kB (step 10's size), ")
    assert "point sft.checkpoint_dir (or runtime.output_root) at a folder on a larger one" in text
    assert text.endswith("rerun the same command: it resumes from step 10") and "\n" not in text

    try:  # the run's end, marking the MLflow run failed on the same full volume, fails too: the first names the folder
        try:
            raise orbax
        except ValueError:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full") from None
    except RuntimeError as outer:
        assert str(disk_full_error(outer, params)) == text
    sqlite = RuntimeError("(sqlite3.OperationalError) database or disk is full")
    text = str(disk_full_error(sqlite, params))
    assert text.startswith(f"no space left on device in {tmp_path / 'out'}: the size it needed is unknown, ")
    (tmp_path / "mlruns").mkdir()
    tracked = {**params, "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlruns/mlflow.db"}}
    text = str(disk_full_error(sqlite, tracked))
    assert text.startswith(f"no space left on device in {tmp_path / 'mlruns'}: ")
    assert "point tracking.tracking_uri (or runtime.output_root) at" in text
    tracked["tracking"]["tracking_uri"] = f"sqlite:///{tmp_path}/out/mlflow.db"  # the default: in the output root
    assert "or point runtime.output_root at" in str(disk_full_error(sqlite, tracked))

    parquet = tmp_path / "out" / "05_model_input"
    parquet.mkdir(parents=True)
    oserror = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(parquet / "train.parquet"))
    text = str(disk_full_error(oserror, params))
    assert text.startswith(f"disk quota exceeded in {parquet}: the size it needed is unknown, ")
    assert "or point runtime.output_root at a folder" in text and "checkpoint_dir" not in text

    for said in ("No space left on device (os error 28)", "(sqlite3.OperationalError) database or disk is full"):
        assert disk_full_cause(Exception(said)) is not None
    oom = ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
    assert disk_full_cause(oom) is None and disk_full_error(oom, params) is None


def test_quiet_drops_the_reports_on_the_way_and_late_loop_callbacks(monkeypatch):
    """The records that report a full disk before the run stops with it (Orbax's threads via absl, Kedro's failed
    node) are dropped, other errors kept; so is `Event loop is closed` from a callback nobody waits for."""
    import logging

    from tunix_pipeline.core import quiet

    unraised = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)
    quiet.install()
    quiet.install()  # twice: one filter per logger, one hook
    full = ValueError("RESOURCE_EXHAUSTED: Failed to write 44033 bytes to file 7: No space left on device")
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    for name in ("absl", "kedro.pipeline.node", "asyncio", "mlflow.store.db.utils"):
        logger = logging.getLogger(name)
        handler = Keep()
        logger.addHandler(handler)
        try:
            logger.error("Save Finalize thread (save_finalize) failed.", exc_info=(ValueError, full, None))
            logger.error("Node train_sft failed with error: \n%s", full)
            logger.error("Exception in callback", exc_info=(RuntimeError, RuntimeError("Event loop is closed"), None))
            logger.error("a real problem", exc_info=(ValueError, ValueError("bad"), None))
        finally:
            logger.removeHandler(handler)
        assert sum(isinstance(f, quiet._DropDiskFull) for f in logger.filters) == 1
    expected = ["Exception in callback"] * 3 + ["a real problem"] * 4  # asyncio's late callback dropped
    assert sorted(kept) == sorted(expected), kept

    class Report:
        def __init__(self, exc):
            self.exc_type, self.exc_value, self.exc_traceback, self.err_msg, self.object = type(exc), exc, None, None, None

    sys.unraisablehook(Report(RuntimeError("Event loop is closed")))
    sys.unraisablehook(Report(RuntimeError("something else")))
    assert [str(r.exc_value) for r in unraised] == ["something else"]
