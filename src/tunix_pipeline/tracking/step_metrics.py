"""Per-step metrics of the trainers (SFT, preference, GRPO): Tunix metrics backends for the active MLflow run and
for Weights & Biases, on process 0 only."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import mlflow
import numpy as np
from tunix.sft.metrics_logger import WandbBackend

from tunix_pipeline.config import TrackingParams, WandbParams
from tunix_pipeline.tracking.mlflow_runs import mlflow_name, numeric

COMPILE_EVENT = "jax/core/compile/backend_compile_duration"


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
        number = numeric(np.asarray(value).item() if hasattr(value, "shape") else value)
        step = int(kwargs.get("step") or 0)
        if number is None or (step and step <= self.last_logged_step(name)):
            return
        if step != self._pending_step:
            self.flush()
        self._pending.append(mlflow.entities.Metric(name, number, int(time.time() * 1000), step))
        self._pending_step = step
        if step:
            self._logged_until[name] = step

    def fill_gaps(self, name: str, history: list[dict], key: str = "loss") -> None:
        """Logs the steps of `history` ({step, `key`}) that the run lacks (e.g. the one Tunix had not written yet)."""
        name = mlflow_name(name)
        logged = {m.step for m in self._client.get_metric_history(self._run_id, name)}
        for entry in history:
            if entry["step"] not in logged and entry.get(key) is not None:
                self._client.log_metric(self._run_id, name, entry[key], step=entry["step"])

    def flush(self) -> None:
        if self._pending:
            self._client.log_batch(self._run_id, metrics=self._pending)
            self._pending = []

    def close(self) -> None:
        self.flush()


def metrics_backends(tracking: TrackingParams, output_root: str, stage: str) -> list | None:
    """Tunix metrics backends (factories) for process 0: the active MLflow run, and W&B when enabled."""
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
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"entity": params.entity, "mode": params.mode, "dir": str(folder), "group": mlflow_run_id}
    if mlflow_run_id:
        kwargs.update(id=f"{mlflow_run_id}-{stage}", resume="allow")
    return WandbBackend(project=params.project, name=f"{stage}-{mlflow_run_id or 'untracked'}", **kwargs)
