import jax
import mlflow
import pandas as pd

from tunix_pipeline.config import ModelParams, RuntimeParams, SftParams
from tunix_pipeline.models import load_run_model, parameter_counts
from tunix_pipeline.tracking import MlflowBackend, remember_run
from tunix_pipeline.training import make_mesh, train


def train_sft(
    train_tokens: pd.DataFrame,
    eval_tokens: pd.DataFrame,
    base_model: dict,
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
) -> dict:
    mesh = make_mesh(runtime)
    network, _ = load_run_model(base_model["path"], model, mesh, remat=sft.remat)
    live = mlflow.active_run() is not None and jax.process_index() == 0
    if live:
        remember_run(sft.checkpoint_dir)
    result = train(
        network, train_tokens, eval_tokens, sft, mesh, [MlflowBackend] if live else None, runtime.peak_flops_per_device
    )
    if live:
        MlflowBackend().fill_gaps("train/loss", result["loss_history"])
    return {
        **result,
        **parameter_counts(network),
        "lora": model.lora is not None,
        "mesh": dict(mesh.shape),
        "base_model": base_model["path"],
    }
