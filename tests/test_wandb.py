"""Weights & Biases as the optional second tracker, offline (no network here), through Tunix's backend."""

import mlflow
import pytest

from tunix_pipeline.config import SftParams, TokenizeParams, TrackingParams
from tunix_pipeline.data.tokenization import tokenize_split
from tunix_pipeline.models import load_model
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.tracking.step_metrics import MlflowBackend, metrics_backends
from tunix_pipeline.train.sft import train

from .test_training import MESH, formatted  # noqa: F401  (the fixture)

pytest.importorskip("wandb")


@pytest.mark.slow
def test_training_curves_reach_mlflow_and_wandb(tmp_path, tiny_model_dir, tokenizer, formatted, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = tokenize_split(formatted, tokenizer, TokenizeParams(max_length=48))[0]
    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh)
    sft = SftParams(max_steps=4, per_device_batch_size=1, learning_rate=1e-2, warmup_steps=1,
                    checkpoint_every=4, checkpoint_dir=str(tmp_path / "ckpt"))
    tracking = TrackingParams(wandb={"enabled": True, "mode": "offline", "project": "test"}, log_outputs=[])
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("wandb_test")  # not the experiment an earlier test left active in another store
    with mlflow.start_run() as run:
        backends = metrics_backends(tracking, str(tmp_path), "sft")
        assert backends[0] is MlflowBackend and len(backends) == 2
        result = train(model, rows, rows.iloc[:0], sft, mesh, backends)
    mlflow.set_tracking_uri("")
    assert len(mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "train/loss")) >= 3

    # the offline run (to `wandb sync` later) holds a train/loss record per logged step
    (offline,) = (tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run.info.run_id}-sft")
    records = (offline / f"run-{run.info.run_id}-sft.wandb").read_bytes()
    assert records.count(b"train/loss") >= len(result["history"]) - 1
