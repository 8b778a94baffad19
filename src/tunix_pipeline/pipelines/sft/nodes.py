import jax
import mlflow
import pandas as pd

from tunix_pipeline.checkpoints import start_from
from tunix_pipeline.config import ModelParams, PlanParams, RuntimeParams, SftParams, TrackingParams
from tunix_pipeline.dev_eval import DevEval, log_curve
from tunix_pipeline.models import load_run_model, load_tokenizer, parameter_counts
from tunix_pipeline.planning import peak_flops_per_device
from tunix_pipeline.step_metrics import MlflowBackend, metrics_backends
from tunix_pipeline.tracking import mlflow_name, remember_run
from tunix_pipeline.runtime import global_batch_size, make_mesh
from tunix_pipeline.training import train


def train_sft(
    train_tokens: pd.DataFrame,
    eval_tokens: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
    tracking: TrackingParams,
    plan: PlanParams,
) -> dict:
    mesh = make_mesh(runtime)
    network, _ = load_run_model(base_model["path"], model, mesh, remat=sft.remat, compute_dtype=sft.compute_dtype)
    live = mlflow.active_run() is not None and jax.process_index() == 0
    lineage = start_from(network, sft.init_from, sft.checkpoint_dir) if sft.init_from else {}
    if live and lineage:
        mlflow.set_tags({mlflow_name(f"lineage.{k}"): v for k, v in lineage.items() if v is not None})
    described = {
        **parameter_counts(network),
        **lineage,
        "lora": model.lora is not None,
        "mesh": dict(mesh.shape),
        "base_model": base_model["path"],
    }
    if sft.max_steps == 0:  # nothing to train this session: the parent checkpoint is the result
        batch_size = global_batch_size(sft, mesh)
        return {
            "checkpoint_dir": lineage["parent_checkpoint"], "latest_step": lineage["parent_step"],
            "steps_this_run": 0, "stopped_early": None, "loss_history": [], "first_loss": None, "last_loss": None,
            "global_batch_size": batch_size * sft.gradient_accumulation_steps, "micro_batch_size": batch_size,
            # the parent's dev-selected step passes on as this session's
            "best_step": lineage.get("parent_best_step"), "selected_step": lineage["parent_step"], "dev_curve": [],
            **described,
        }
    if live:
        remember_run(sft.checkpoint_dir)
    # the dev split's score and the best step (`sft.dev_eval`)
    dev = DevEval(sft.dev_eval, load_tokenizer(base_model["path"]), eval_formatted, "sft",
                  runtime.decode_weights) if sft.dev_eval else None
    result = train(
        network, train_tokens, eval_tokens, sft, mesh,
        metrics_backends(tracking, runtime.output_root, "sft"), peak_flops_per_device(plan, runtime), dev,
    )
    if live:
        MlflowBackend().fill_gaps("train/loss", result["loss_history"])
        log_curve(result["dev_curve"], "sft")
    return {**result, **described}
