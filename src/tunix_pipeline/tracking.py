"""MLflow tracking: the run's lifecycle, a Tunix metrics backend, and node outputs.

Only JAX process 0 talks to MLflow. The default store is the embedded
`sqlite:///<output_root>/mlflow.db`, artifacts beside it in `mlruns/`;
`MLFLOW_TRACKING_URI` points at a server instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd

from tunix_pipeline.config import TrackingParams, WandbParams
from tunix_pipeline.paths import storage_path

MAX_PARAM_LENGTH = 6000  # MLflow's limit on one parameter value
MAX_NAME_LENGTH = 250  # MLflow's limit on a metric, parameter or tag name
COMPILE_EVENT = "jax/core/compile/backend_compile_duration"
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_\-.:/]")  # MLflow also allows spaces; "_" keeps names one word


def mlflow_name(name: str) -> str:
    """`name` made valid as an MLflow metric, parameter or tag name, or an artifact path.

    MLflow allows letters, digits and `_-. :/`, at most 250 characters, and no name that
    would resolve to another as a path (`a//b`, `a/./b`, `../a`, `/a`, `a/`). Every name
    that reaches MLflow goes through here: they hold source names, columns and reasons from
    user data. Valid names are returned unchanged.
    """
    parts = [_NAME_CHARS.sub("_", part) for part in str(name).split("/") if part]
    parts = ["_" * len(part) if not part.strip(".") else part for part in parts]  # "." and ".." segments
    name = "/".join(parts) or "_"
    if name.startswith("."):
        name = "_" + name[1:]
    if len(name) > MAX_NAME_LENGTH:  # cut, with a hash of the whole so that long names stay distinct
        name = name[: MAX_NAME_LENGTH - 9].rstrip("/") + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def tracking_uri(params: TrackingParams, project_path: Path) -> str:
    """MLFLOW_TRACKING_URI, else the configured URI with a relative sqlite path made absolute.

    Absolute because MLflow caches stores by URI: a relative one would keep
    pointing at the first project used in the process.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix) :]).is_absolute():
        uri = prefix + str((project_path / uri[len(prefix) :]).resolve())
    return uri


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def start_run(uri: str, params: TrackingParams, all_params: Mapping, tags: Mapping[str, str], run_id: str | None = None):
    """A new MLflow run, or the unfinished run `run_id` continued (a resumed training)."""
    mlflow.set_tracking_uri(uri)
    if uri.startswith("sqlite:///") and mlflow.get_experiment_by_name(params.experiment) is None:
        # artifacts beside the store (not in the working directory), so the output root holds everything
        artifacts = Path(uri[len("sqlite:///") :]).parent / "mlruns" / params.experiment
        mlflow.create_experiment(params.experiment, artifact_location=str(artifacts))
    mlflow.set_experiment(params.experiment)
    flat = {mlflow_name(k): str(v)[:MAX_PARAM_LENGTH] for k, v in flatten(all_params).items()}
    if run_id is not None:
        logged = mlflow.MlflowClient().get_run(run_id).data.params
        changed = sorted(k for k in flat if k in logged and logged[k] != flat[k])
        flat = {k: v for k, v in flat.items() if k not in logged}  # MLflow refuses to change a parameter
        tags = {**tags, "resumed": "true", "resumed_with_changed_params": ",".join(changed) or None}
    run = mlflow.start_run(run_id=run_id, tags={mlflow_name(k): v for k, v in tags.items() if v is not None})
    mlflow.log_params(flat)
    return run


RUN_FILE = "mlflow_run.json"


def remember_run(checkpoint_dir: str | Path) -> None:
    """Records the active run beside the checkpoints, so that resuming them continues it."""
    run = mlflow.active_run()
    if run is None:
        return
    folder = storage_path(checkpoint_dir)  # local, or a gs:// URI beside the checkpoints
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}))


def recorded_run(checkpoint_dir: str | Path) -> str | None:
    """The MLflow run that trained these checkpoints (None when it was not tracked)."""
    path = storage_path(checkpoint_dir) / RUN_FILE
    return json.loads(path.read_text())["run_id"] if path.is_file() else None


def unfinished_run(checkpoint_dir: str | Path, uri: str) -> str | None:
    """The run that trained these checkpoints, when it never finished (killed or preempted)."""
    path = storage_path(checkpoint_dir) / RUN_FILE
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text())
    if recorded.get("tracking_uri") != uri:
        return None
    try:
        run = mlflow.MlflowClient(tracking_uri=uri).get_run(recorded["run_id"])
    except Exception:  # deleted, or another store
        return None
    return run.info.run_id if run.info.status != "FINISHED" else None


def end_run(failed: bool) -> None:
    if mlflow.active_run() is not None:
        mlflow.end_run(status="FAILED" if failed else "FINISHED")


def _numeric(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(float(value)):
        return float(value)
    return None


# Keys in node outputs that hold configuration (sizes, shapes, settings), not measurements:
# logged as parameters, so that the run's metrics are what it measured
CONFIG_KEYS = frozenset({
    "architecture", "mesh", "assumptions", "max_length", "sequence_length", "beta", "completions_per_step",
    "global_batch_size", "micro_batch_size", "global_batch", "per_device_batch", "gradient_accumulation",
    "devices", "memory_gib", "lm_eval",
})


def log_output(name: str, value) -> None:
    """Logs one node output to the active run, by type: a mapping as JSON plus its numbers as metrics
    (its configuration keys as parameters), a table as JSON lines, a text as Markdown."""
    if isinstance(value, Mapping):
        mlflow.log_dict(_jsonable(value), mlflow_name(f"{name}.json"))
        metrics, params = {}, {}
        for key, item in flatten(value).items():
            if CONFIG_KEYS.intersection(str(key).split(".")):
                if isinstance(item, (str, int, float, bool, np.number)):
                    params[mlflow_name(f"{name}.{key}")] = str(item)[:MAX_PARAM_LENGTH]
            elif (number := _numeric(item)) is not None:
                metrics[mlflow_name(f"{name}.{key}")] = number
        mlflow.log_metrics(metrics)
        if params:
            # MLflow refuses to change a parameter: a resumed run keeps the values it logged first
            logged = mlflow.MlflowClient().get_run(mlflow.active_run().info.run_id).data.params
            mlflow.log_params({k: v for k, v in params.items() if k not in logged})
    elif isinstance(value, pd.DataFrame):
        mlflow.log_text(value.to_json(orient="records", lines=True), mlflow_name(f"{name}.jsonl"))
    elif isinstance(value, str):
        mlflow.log_text(value, mlflow_name(f"{name}.md"))


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


@contextlib.contextmanager
def scalar_listeners_scope():
    """Scalar listeners added inside are removed on exit; stale MLflow ones from earlier stages before.

    Tunix's `MetricsLogger.close()` calls `jax.monitoring.clear_event_listeners()`, which in
    jax 0.10 forgets scalar listeners (it assigns a local `_scalar_listeners`), so a closed
    trainer's backend keeps receiving every later metric: SFT's MLflow backend would log each
    GRPO metric a second time.
    """
    import jax
    from jax._src import monitoring

    def listeners():
        return list(monitoring.get_scalar_listeners())

    for listener in listeners():
        if isinstance(getattr(listener, "__self__", None), MlflowBackend):
            jax.monitoring.unregister_scalar_listener(listener)
    before = listeners()
    try:
        yield
    finally:
        for listener in listeners():
            if listener not in before:
                jax.monitoring.unregister_scalar_listener(listener)


class MlflowBackend:
    """A Tunix/metrax `LoggingBackend`: per-step scalars to the active MLflow run.

    Tunix names events `<prefix>/<mode>/<metric>`, e.g. `/train/loss`; they are
    logged as `train/loss` at the event's step. In a continued run, steps that
    are already logged are skipped: a resumed training replays the steps after
    its checkpoint with the same values, and MLflow keeps one value per step.

    A step's metrics are written together (one database write, not one per
    metric) when the next step's first metric arrives, or at `close`.
    """

    def __init__(self):
        run = mlflow.active_run()
        if run is None:
            raise RuntimeError("MlflowBackend needs an active MLflow run")
        self._client = mlflow.MlflowClient()
        self._run_id = run.info.run_id
        self._logged_until: dict[str, int] = {}
        self._pending: list[mlflow.entities.Metric] = []
        self._pending_step: int | None = None

    def last_logged_step(self, name: str) -> int:
        if name not in self._logged_until:
            history = self._client.get_metric_history(self._run_id, name)
            self._logged_until[name] = max((m.step for m in history), default=0)
        return self._logged_until[name]

    def log_scalar(self, event: str, value, **kwargs) -> None:
        name = event.strip("/")
        # JAX and Orbax report their own internals on the same channel; keep compile time only
        if name.startswith("jax/") and name != COMPILE_EVENT:
            return
        name = mlflow_name(name)  # reward names come from the configuration
        number = _numeric(np.asarray(value).item() if hasattr(value, "shape") else value)
        step = int(kwargs.get("step") or 0)
        if number is None or (step and step <= self.last_logged_step(name)):
            return
        if step != self._pending_step:
            self.flush()
        self._pending.append(mlflow.entities.Metric(name, number, int(time.time() * 1000), step))
        self._pending_step = step
        if step:
            self._logged_until[name] = step

    def fill_gaps(self, name: str, history: list[dict]) -> None:
        """Logs the steps of `history` ({step, loss}) that the run lacks (e.g. the one Tunix had not written yet)."""
        name = mlflow_name(name)
        logged = {m.step for m in self._client.get_metric_history(self._run_id, name)}
        for entry in history:
            if entry["step"] not in logged:
                self._client.log_metric(self._run_id, name, entry["loss"], step=entry["step"])

    def flush(self) -> None:
        if self._pending:
            self._client.log_batch(self._run_id, metrics=self._pending)
            self._pending = []

    def close(self) -> None:
        self.flush()


def metrics_backends(tracking: TrackingParams, output_root: str, stage: str) -> list | None:
    """Tunix metrics backends (factories) for process 0: the active MLflow run, and W&B when enabled."""
    import jax

    if jax.process_index() != 0:
        return None
    run = mlflow.active_run()
    backends = [MlflowBackend] if run is not None else []
    if tracking.wandb.enabled:
        run_id = run.info.run_id if run is not None else None
        backends.append(lambda: _wandb_backend(tracking.wandb, Path(output_root) / "wandb", stage, run_id))
    return backends or None


def _wandb_backend(params: WandbParams, folder: Path, stage: str, mlflow_run_id: str | None):
    """Tunix's W&B backend; one W&B run per stage of an MLflow run, continued when that run resumes."""
    from tunix.sft.metrics_logger import WandbBackend

    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"entity": params.entity, "mode": params.mode, "dir": str(folder), "group": mlflow_run_id}
    if mlflow_run_id:
        kwargs.update(id=f"{mlflow_run_id}-{stage}", resume="allow")
    return WandbBackend(project=params.project, name=f"{stage}-{mlflow_run_id or 'untracked'}", **kwargs)
