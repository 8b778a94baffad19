"""Supervised fine-tuning with Tunix's `PeftTrainer` on a device mesh.

What we add around the trainer, through its own seams:
- a completion-only loss on integer labels (Tunix's default one-hot encodes
  the whole vocabulary: 256k wide for Gemma);
- fixed-size, seeded, resumable batches (Tunix resumes by skipping the
  batches it already trained on, so the order must be reproducible);
- per-step metrics to MLflow through a Tunix metrics backend;
- a loss history kept beside the checkpoints, so a resumed run reports the
  whole curve.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
from flax import nnx

from tunix_pipeline.config import RuntimeParams, SftParams
from tunix_pipeline.tokenization import stack

log = logging.getLogger(__name__)
HISTORY_FILE = "loss_history.json"


class MeshError(ValueError):
    """A mesh or batch size that does not fit the devices."""


# ---------------------------------------------------------------- mesh
def make_mesh(runtime: RuntimeParams, devices=None) -> jax.sharding.Mesh:
    """A (fsdp, tp) mesh over all devices; both axes always exist (Tunix's shardings name them)."""
    devices = devices if devices is not None else jax.devices()
    if runtime.mesh == "auto":
        shape = {"fsdp": len(devices), "tp": 1}
    else:
        shape = {"fsdp": runtime.mesh.get("fsdp", 1), "tp": runtime.mesh.get("tp", 1)}
    size = shape["fsdp"] * shape["tp"]
    if size != len(devices):
        raise MeshError(
            f"runtime.mesh {shape} needs {size} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); set `runtime.mesh: auto` or sizes whose product is {len(devices)}"
        )
    return jax.make_mesh(
        tuple(shape.values()),
        tuple(shape.keys()),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=devices,
    )


def global_batch_size(sft: SftParams, mesh: jax.sharding.Mesh) -> int:
    """Per-device batch times the data-parallel (fsdp) devices; tp devices share a batch."""
    return sft.per_device_batch_size * mesh.shape["fsdp"]


# ---------------------------------------------------------------- data
def batches(rows: pd.DataFrame, batch_size: int, seed: int, epochs: int | None = None):
    """Seeded epochs of full batches (the remainder of each epoch is dropped: one shape, one compile)."""
    arrays = {
        "input_tokens": stack(rows, "input_tokens"),
        "loss_mask": stack(rows, "loss_mask"),
        "attention_mask": stack(rows, "attention_mask"),
    }
    n = len(rows)
    if n < batch_size:
        raise MeshError(
            f"{n} training rows cannot fill one global batch of {batch_size}; "
            "lower `sft.per_device_batch_size` or add data"
        )
    rng = np.random.default_rng(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield {k: v[idx] for k, v in arrays.items()}
        epoch += 1


def eval_batches(rows: pd.DataFrame, batch_size: int):
    """Every eval row once; the last batch is padded with rows that carry no loss."""
    arrays = {
        "input_tokens": stack(rows, "input_tokens"),
        "loss_mask": stack(rows, "loss_mask"),
        "attention_mask": stack(rows, "attention_mask"),
    }
    n = len(rows)
    for start in range(0, n, batch_size):
        batch = {k: v[start : start + batch_size] for k, v in arrays.items()}
        short = batch_size - len(batch["input_tokens"])
        if short:
            batch = {
                k: np.concatenate([v, np.zeros((short, v.shape[1]), v.dtype) if k != "input_tokens" else np.repeat(v[-1:], short, 0)])
                for k, v in batch.items()
            }
            batch["loss_mask"][-short:] = 0
        yield batch


# ---------------------------------------------------------------- model inputs and loss
def model_inputs(batch: dict) -> dict:
    """Positions and the causal + padding attention mask for Tunix models."""
    from tunix.sft import utils as sft_utils

    attention = batch["attention_mask"].astype(bool)
    return {
        "input_tokens": batch["input_tokens"],
        "loss_mask": batch["loss_mask"],
        "positions": sft_utils.build_positions_from_mask(attention),
        "attention_mask": sft_utils.make_causal_attn_mask(attention),
    }


def token_nll(model, input_tokens, loss_mask, positions, attention_mask):
    """(sum of next-token NLL over completion tokens, number of such tokens)."""
    logits, _ = model(input_tokens, positions, None, attention_mask)
    logits = logits[:, :-1].astype(jnp.float32)
    mask = loss_mask[:, 1:].astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, input_tokens[:, 1:])
    return jnp.sum(nll * mask), jnp.sum(mask)


def completion_loss(model, input_tokens, loss_mask, positions, attention_mask):
    """Mean NLL over completion tokens, from integer labels (no one-hot)."""
    total, count = token_nll(model, input_tokens, loss_mask, positions, attention_mask)
    return total / jnp.maximum(count, 1.0)


@nnx.jit
def _batch_nll(model, inputs):
    return token_nll(model, **inputs)


def evaluate_loss(model, rows: pd.DataFrame, batch_size: int, mesh) -> dict:
    """Token-weighted eval loss and perplexity over every row."""
    from tunix.sft import sharding_utils

    total, count = 0.0, 0.0
    with mesh:
        for batch in eval_batches(rows, batch_size):
            inputs = model_inputs(sharding_utils.shard_input(batch, ("fsdp",)))
            s, c = _batch_nll(model, inputs)
            total, count = total + float(s), count + float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": float(np.exp(loss)), "tokens": int(count)}


# ---------------------------------------------------------------- optimizer
def make_optimizer(sft: SftParams) -> optax.GradientTransformation:
    if sft.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, sft.learning_rate, sft.warmup_steps, sft.max_steps, 0.1 * sft.learning_rate)
    elif sft.schedule == "linear":
        lr = optax.join_schedules(
            [optax.linear_schedule(0.0, sft.learning_rate, sft.warmup_steps),
             optax.linear_schedule(sft.learning_rate, 0.0, sft.max_steps - sft.warmup_steps)],
            [sft.warmup_steps],
        )
    else:
        lr = optax.linear_schedule(0.0, sft.learning_rate, sft.warmup_steps) if sft.warmup_steps else sft.learning_rate

    def build(learning_rate):
        if sft.optimizer == "adamw":
            core = optax.adamw(learning_rate, weight_decay=sft.weight_decay)
        else:
            core = optax.adafactor(learning_rate, weight_decay_rate=sft.weight_decay or None)
        if sft.max_grad_norm is None:
            return core
        return optax.chain(optax.clip_by_global_norm(sft.max_grad_norm), core)

    # inject_hyperparams lets Tunix read and log the learning rate every step
    return optax.inject_hyperparams(build)(learning_rate=lr)


# ---------------------------------------------------------------- the run
def _throughput_hooks(tokens_per_step: int):
    from tunix.sft import hooks

    class Throughput(hooks.TrainingHooks):
        """Logs tokens/s between consecutive steps (padded tokens: the work the device does)."""

        def __init__(self):
            self.last = None

        def on_train_start(self, trainer):
            self.last = None

        def on_train_step_end(self, trainer, train_step, train_loss):
            now = time.perf_counter()
            if self.last is not None:
                trainer.metrics_logger.log("", "tokens_per_sec", tokens_per_step / (now - self.last), "train", train_step)
            self.last = now

        def on_train_end(self, trainer): ...
        def on_train_step_start(self, trainer): ...
        def on_eval_step_start(self, trainer): ...
        def on_eval_step_end(self, trainer, eval_loss): ...

    return Throughput()


def train(
    model,
    train_rows: pd.DataFrame,
    eval_rows: pd.DataFrame,
    sft: SftParams,
    mesh: jax.sharding.Mesh,
    metrics_backends: list | None = None,
) -> dict:
    """Trains `model` in place; resumes from the latest checkpoint in `sft.checkpoint_dir`."""
    import orbax.checkpoint as ocp
    from tunix.sft import metrics_logger, peft_trainer

    batch_size = global_batch_size(sft, mesh)
    seq_len = len(train_rows["input_tokens"].iloc[0])
    ckpt_dir = Path(sft.checkpoint_dir).resolve()
    options = None
    if metrics_backends:
        options = metrics_logger.MetricsLoggerOptions(
            log_dir=str(ckpt_dir / "logs"), backend_kwargs={"custom_backend": metrics_backends}
        )
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=sft.eval_every or sft.max_steps + 1,
        max_steps=sft.max_steps,
        checkpoint_root_directory=str(ckpt_dir),
        checkpointing_options=ocp.CheckpointManagerOptions(
            # every N steps (and on a preemption notice), without Orbax's extra save at the first step;
            # the trainer always saves the last step when it stops
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy(
                [
                    ocp.checkpoint_managers.FixedIntervalPolicy(sft.checkpoint_every),
                    ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
                ]
            ),
            max_to_keep=sft.keep_checkpoints,
        ),
        data_sharding_axis=("fsdp",),
        pbar_description="sft",
    )
    with mesh:
        trainer = peft_trainer.PeftTrainer(
            model, make_optimizer(sft), config, metrics_logger=metrics_logger.MetricsLogger(options)
        )
        trainer.with_loss_fn(completion_loss).with_gen_model_input_fn(model_inputs)
        trainer.with_training_hooks(_throughput_hooks(batch_size * seq_len))
        start_step = trainer.train_steps
        history = _load_history(ckpt_dir, start_step)
        if start_step:
            log.info("resuming SFT from checkpoint step %d in %s", start_step, ckpt_dir)
        eval_iter = eval_batches(eval_rows, batch_size) if sft.eval_every and len(eval_rows) else None
        started = time.perf_counter()
        trainer.train(batches(train_rows, batch_size, sft.seed), list(eval_iter) if eval_iter else None)
        seconds = time.perf_counter() - started
        end_step = trainer.train_steps

    new_losses = _history_of(trainer, "loss")
    history += [{"step": start_step + i + 1, "loss": float(v)} for i, v in enumerate(new_losses)]
    _save_history(ckpt_dir, history)
    tokens_per_sec = _history_of(trainer, "tokens_per_sec")
    return {
        "checkpoint_dir": str(ckpt_dir),
        "latest_step": end_step,
        "resumed_from_step": start_step,
        "steps_this_run": end_step - start_step,
        "global_batch_size": batch_size,
        "sequence_length": seq_len,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "loss_history": history,
        "train_seconds": seconds,
        "median_tokens_per_sec": float(np.median(tokens_per_sec)) if len(tokens_per_sec) else None,
    }


def _history_of(trainer, name: str) -> np.ndarray:
    if not trainer.metrics_logger.metric_exists("", name, "train"):
        return np.array([])
    return np.asarray(trainer.metrics_logger.get_metric_history("", name, "train"), dtype=np.float64).ravel()


def _load_history(ckpt_dir: Path, upto_step: int) -> list[dict]:
    path = ckpt_dir / HISTORY_FILE
    if not upto_step or not path.is_file():
        return []
    return [h for h in json.loads(path.read_text()) if h["step"] <= upto_step]


def _save_history(ckpt_dir: Path, history: list[dict]) -> None:
    if jax.process_index() != 0:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / (HISTORY_FILE + ".tmp")
    tmp.write_text(json.dumps(history))
    tmp.replace(ckpt_dir / HISTORY_FILE)


def restore_latest(model, checkpoint_dir: str | Path) -> int:
    """Loads the latest SFT checkpoint into `model` (only its adapters when it has LoRA); returns the step (0: none)."""
    from tunix.sft import checkpoint_manager
    from tunix.sft import utils as sft_utils

    manager = checkpoint_manager.CheckpointManager(str(Path(checkpoint_dir).resolve()))
    try:
        step, _ = manager.maybe_restore(model, restore_only_lora_params=sft_utils.is_lora_enabled(model))
    finally:
        manager.close()
    return step
