"""MLflow tracking: the run's lifecycle, a Tunix metrics backend, and node outputs.

Only JAX process 0 talks to MLflow. The default store is the embedded
`sqlite:///mlflow.db`; `MLFLOW_TRACKING_URI` points at a server instead.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd

from tunix_pipeline.config import TrackingParams

MAX_PARAM_LENGTH = 6000  # MLflow's limit on one parameter value
COMPILE_EVENT = "jax/core/compile/backend_compile_duration"


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


def start_run(uri: str, params: TrackingParams, all_params: Mapping, tags: Mapping[str, str]):
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(params.experiment)
    run = mlflow.start_run(tags={k: v for k, v in tags.items() if v is not None})
    mlflow.log_params({k: str(v)[:MAX_PARAM_LENGTH] for k, v in flatten(all_params).items()})
    return run


def end_run(failed: bool) -> None:
    if mlflow.active_run() is not None:
        mlflow.end_run(status="FAILED" if failed else "FINISHED")


def _numeric(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(float(value)):
        return float(value)
    return None


def log_output(name: str, value) -> None:
    """Logs one node output to the active run, by type."""
    if isinstance(value, Mapping):
        mlflow.log_dict(_jsonable(value), f"{name}.json")
        metrics = {f"{name}.{k}": _numeric(v) for k, v in flatten(value).items()}
        mlflow.log_metrics({k.replace(" ", "_"): v for k, v in metrics.items() if v is not None})
    elif isinstance(value, pd.DataFrame):
        mlflow.log_text(value.to_json(orient="records", lines=True), f"{name}.jsonl")
    elif isinstance(value, str):
        mlflow.log_text(value, f"{name}.md")


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


class MlflowBackend:
    """A Tunix/metrax `LoggingBackend`: per-step scalars to the active MLflow run.

    Tunix names events `<prefix>/<mode>/<metric>`, e.g. `/train/loss`; they are
    logged as `train/loss` at the event's step.
    """

    def __init__(self):
        run = mlflow.active_run()
        if run is None:
            raise RuntimeError("MlflowBackend needs an active MLflow run")
        self._client = mlflow.MlflowClient()
        self._run_id = run.info.run_id

    def log_scalar(self, event: str, value, **kwargs) -> None:
        # JAX and Orbax report their own internals on the same channel; keep compile time only
        if event.startswith("jax/") and event != COMPILE_EVENT:
            return
        number = _numeric(np.asarray(value).item() if hasattr(value, "shape") else value)
        if number is None:
            return
        self._client.log_metric(self._run_id, event.strip("/"), number, step=int(kwargs.get("step") or 0))

    def close(self) -> None:
        pass
