"""Supervised fine-tuning with Tunix's `PeftTrainer` on a device mesh, on the shared loop (`train.loop`):
- a completion-only loss on integer labels (`loss`), optionally chunked, with packed rows attending only
  within their own example;
- per-step metrics to MLflow through a Tunix metrics backend, with step time, tokens/s and MFU both padded and
  useful (non-padding tokens only), the padding share and device memory (`progress.throughput_hooks`);
- a loss history kept beside the checkpoints, so a resumed run reports the whole curve;
- with `sft.dev_eval`, the dev split scored every N steps and the best step kept (`dev_eval`).
"""

from __future__ import annotations

import jax
import pandas as pd
from etils import epath
from tunix.sft import metrics_logger, peft_trainer

from tunix_pipeline import upstream
from tunix_pipeline.config import SftParams
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.progress import throughput_hooks
from tunix_pipeline.core.runtime import global_batch_size, process_rows
from tunix_pipeline.models.architecture import model_flops_per_token
from tunix_pipeline.stages import StageResult
from tunix_pipeline.tracking.mlflow_runs import record_lineage
from tunix_pipeline.train import checkpoints
from tunix_pipeline.train.loop import (
    BatchFeed,
    end_run,
    eval_batches,
    examples_per_row,
    fit,
    restored_trainer,
    trainer_config,
)
from tunix_pipeline.train.loss import loss_fn_for, model_inputs


def _trainer(model, sft: SftParams, mesh, options, ckpt_dir: epath.Path, dev=None):
    """Tunix's PeftTrainer (`upstream.trainer_class`) with gradient accumulation and our metrics backends."""
    config = peft_trainer.TrainingConfig(
        **trainer_config(sft, sft.max_steps, ckpt_dir, "sft", sft.eval_every, dev),
        gradient_accumulation_steps=sft.gradient_accumulation_steps if sft.gradient_accumulation_steps > 1 else None,
    )
    return restored_trainer(
        lambda optimizer: upstream.trainer_class()(model, optimizer, config,
                                                  metrics_logger=metrics_logger.MetricsLogger(options)),
        sft, sft.max_steps, ckpt_dir, mesh,
    )


def train(
    model,
    train_rows: pd.DataFrame,
    eval_rows: pd.DataFrame,
    sft: SftParams,
    mesh: jax.sharding.Mesh,
    metrics_backends: list | None = None,
    peak_flops_per_device: float | None = None,
    dev=None,
) -> StageResult:
    """Trains `model` in place; resumes from the latest checkpoint in `sft.checkpoint_dir`, or, in a new run with
    `sft.init_from`, starts from the parent run's checkpoint (the lineage is in the result, and on the active MLflow
    run). `dev`: a `dev_eval.DevEval` (`sft.dev_eval`) scoring the dev split as it goes and keeping the best step, or
    None. With `sft.max_steps: 0` nothing is trained and the parent's checkpoint is the result."""
    # the folders as paths once, here; a gs:// URI reaches Orbax as it is
    ckpt_dir = storage_path(sft.checkpoint_dir)
    parent = storage_path(sft.init_from) if sft.init_from else None
    trains = sft.max_steps != 0  # by steps, or by epochs (None)
    lineage = record_lineage(checkpoints.start_from(model, parent, ckpt_dir) if parent else {}, parent,
                             ckpt_dir if trains else None)
    batch_size = global_batch_size(sft, mesh)
    if not trains:
        return _parent_passed_on(lineage, sft, batch_size)
    local = process_rows(mesh, batch_size)
    seq_len = len(train_rows["input_tokens"].iloc[0])
    feed = BatchFeed(train_rows, batch_size, sft.seed, local, micro_batches=sft.gradient_accumulation_steps)
    feed.with_budget(sft.time_budget_hours, model)
    sft = sft.steps_for(len(train_rows), batch_size)  # sft.epochs -> max_steps, now that the rows are known
    if sft.eval_every and len(eval_rows):
        feed.with_eval(eval_batches(eval_rows, batch_size, local))
    flops_per_token = model_flops_per_token(model, seq_len)

    with upstream.scalar_listeners_scope(), mesh:
        trainer = _trainer(model, sft, mesh, checkpoints.logger_options(ckpt_dir, metrics_backends), ckpt_dir, dev)
        if dev:
            examples = batch_size * sft.gradient_accumulation_steps * examples_per_row(feed.arrays)
            dev.start(trainer, mesh, ckpt_dir, examples, stopping=lambda: feed.interrupted)
        trainer.with_loss_fn(loss_fn_for(sft)).with_gen_model_input_fn(model_inputs)
        trainer.with_training_hooks(
            throughput_hooks(feed.step_tokens, flops_per_token, peak_flops_per_device, mesh.devices.size)
        )
        trainer.with_data_hooks(feed)
        run = fit(trainer, feed, ckpt_dir, "SFT", sft.max_steps)
        if dev and not feed.interrupted:
            dev.catch_up(trainer.train_steps, mesh)

    history = run.pop("history") + checkpoints.new_losses(trainer, run["resumed_from_step"])
    checkpoints.save_history(ckpt_dir, history)
    # multi-host: Orbax syncs every process before each save and after its finalisation, and the
    # in-training evaluation is one SPMD program; the barrier lets no process go on to the next
    # stage (evaluate, which restores the checkpoints) before process 0 has written the history too
    end_run(feed, "sft", run, sft.max_steps, sft.time_budget_hours)
    return {
        **run,
        **lineage,
        "global_batch_size": batch_size * sft.gradient_accumulation_steps,
        "micro_batch_size": batch_size,
        "sequence_length": seq_len,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "history": history,
        # without `dev`, the latest step is the one handed on
        **(dev.summary(run["latest_step"]) if dev else checkpoints.no_dev_eval(run["latest_step"])),
    }


def _parent_passed_on(lineage: dict, sft: SftParams, batch_size: int) -> StageResult:
    """A session that trains nothing (`sft.max_steps: 0`, which needs `sft.init_from`): the parent's checkpoint,
    and its dev-selected step, are this session's."""
    return {
        "checkpoint_dir": lineage["parent_checkpoint"], "latest_step": lineage["parent_step"],
        "steps_this_run": 0, "stopped_early": None, "history": [], "first_loss": None, "last_loss": None,
        "global_batch_size": batch_size * sft.gradient_accumulation_steps, "micro_batch_size": batch_size,
        "best_step": lineage.get("parent_best_step"), "selected_step": lineage["parent_step"], "dev_curve": [],
        **lineage,
    }
