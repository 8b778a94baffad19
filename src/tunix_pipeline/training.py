"""Supervised fine-tuning with Tunix's `PeftTrainer` on a device mesh.

What we add around the trainer, through its own seams:
- a completion-only loss on integer labels (`loss`), optionally chunked, with
  packed rows attending only within their own example;
- batches that are a pure function of the step (`BatchFeed`, a Tunix data
  hook): a resumed run sees exactly the batches an uninterrupted run would
  (Tunix itself replays the iterator and skips), each process reads only its
  share, and SIGTERM or the session budget end the run with a checkpoint;
- per-step metrics to MLflow through a Tunix metrics backend, with step time,
  tokens/s, MFU and device memory;
- a loss history kept beside the checkpoints, so a resumed run reports the
  whole curve; a corrupt latest checkpoint is set aside for the previous one
  (both in `checkpoints`).
"""

from __future__ import annotations

import functools
import logging
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from etils import epath
from flax import nnx

from tunix_pipeline import checkpoints
from tunix_pipeline.config import SftParams
from tunix_pipeline.loss import loss_fn_for, model_inputs, token_nll
from tunix_pipeline.optim import make_optimizer
from tunix_pipeline.paths import storage_path
from tunix_pipeline.progress import Progress
from tunix_pipeline.runtime import BATCH_AXES, MeshError, global_batch_size, process_rows, shard_rows
from tunix_pipeline.runtime import barrier as _sync
from tunix_pipeline.tokenization import token_arrays

log = logging.getLogger(__name__)


class TrainingInterrupted(RuntimeError):
    """SIGTERM (preemption) stopped training after a checkpoint was saved."""


# ---------------------------------------------------------------- data
class BatchFeed:
    """Batch `i` of a run is a pure function of `i`: seeded epochs of full batches.

    A Tunix `DataHooks`: the trainer asks for the batch of its current step, so
    a resumed run continues exactly where an uninterrupted run would be. It also
    ends the run (returns None, after which Tunix saves a last checkpoint) on
    SIGTERM or when the session budget leaves only the time to save.
    """

    def __init__(self, rows: pd.DataFrame, batch_size: int, seed: int, local: slice | None = None, arrays=None):
        self.arrays = token_arrays(rows) if arrays is None else arrays  # arrays: other columns (preference pairs)
        self.n = len(rows)
        if self.n < batch_size:
            raise MeshError(
                f"{self.n} training rows cannot fill one global batch of {batch_size}; "
                "lower `sft.per_device_batch_size` or add data"
            )
        self.batch_size, self.seed = batch_size, seed
        self.local = local or slice(0, batch_size)
        self.per_epoch = self.n // batch_size  # the remainder of each epoch is dropped: one shape, one compile
        self.stop_reason: str | None = None
        self._eval: list[dict] = []
        self._eval_iter = None
        self._deadline = None
        self._clock = StepClock()

    def batch(self, step: int) -> dict:
        epoch, k = divmod(step, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        idx = order[k * self.batch_size : (k + 1) * self.batch_size][self.local]
        return {name: a[idx] for name, a in self.arrays.items()}

    def stop(self, reason: str) -> None:
        self.stop_reason = reason

    def with_deadline(self, deadline: float | None, save_seconds: float) -> BatchFeed:
        self._deadline, self._clock.save_seconds = deadline, save_seconds
        return self

    def with_eval(self, batches: list[dict]) -> BatchFeed:
        self._eval = batches
        return self

    # -- tunix.sft.hooks.DataHooks
    def load_next_train_batch(self, trainer):
        self._clock.tick()
        if self._deadline is not None and self.stop_reason is None and self._clock.must_stop(self._deadline):
            self.stop("session time budget")
        if self.stop_reason:
            return None
        return self.batch(trainer.iter_steps)

    def load_next_eval_batch(self, trainer):
        if self._eval_iter is None:
            self._eval_iter = iter(self._eval)
        batch = next(self._eval_iter, None)
        if batch is None:
            self._eval_iter = None  # ready for the next evaluation
        return batch


class StepClock:
    """Wall time per step and per checkpoint save, to stop before a deadline with time to save."""

    def __init__(self):
        self.last = None
        self.intervals: list[float] = []
        self.save_seconds = 1.0

    def tick(self) -> None:
        now = time.time()
        if self.last is not None:
            self.intervals.append(now - self.last)
            if len(self.intervals) > 5:
                # a step far slower than usual included a save: learn how long saving takes
                typical = float(np.median(self.intervals[-50:]))
                if self.intervals[-1] > 3 * typical:
                    self.save_seconds = max(self.save_seconds, self.intervals[-1] - typical)
        self.last = now

    def must_stop(self, deadline: float) -> bool:
        step = float(np.median(self.intervals[-50:])) if self.intervals else 0.0
        return time.time() + 2 * step + 1.5 * self.save_seconds >= deadline


def eval_batches(rows: pd.DataFrame, batch_size: int, local: slice | None = None) -> list[dict]:
    """Every eval row once; the last batch is padded with rows that carry no loss."""
    arrays = token_arrays(rows)
    out = []
    for start in range(0, len(rows), batch_size):
        batch = {k: v[start : start + batch_size] for k, v in arrays.items()}
        short = batch_size - len(batch["input_tokens"])
        if short:
            batch = {k: np.concatenate([v, np.repeat(v[-1:], short, 0)]) for k, v in batch.items()}
            batch["loss_mask"][-short:] = 0
        out.append({k: v[local] if local else v for k, v in batch.items()})
    return out


# ---------------------------------------------------------------- evaluation loss
@nnx.jit
def _batch_nll(model, inputs):
    return token_nll(model, **inputs)


def evaluate_loss(model, rows: pd.DataFrame, batch_size: int, mesh) -> dict:
    """Token-weighted eval loss and perplexity over every row."""
    total, count = 0.0, 0.0
    with mesh:
        for batch in eval_batches(rows, batch_size, process_rows(mesh, batch_size)):
            inputs = model_inputs(shard_rows(batch, mesh))
            s, c = _batch_nll(model, inputs)
            total, count = total + float(s), count + float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": float(np.exp(loss)), "tokens": int(count)}


# ---------------------------------------------------------------- metrics
def train_flops_per_token(model, seq_len: int, remat: str = "none") -> float:
    """The plan's count (`Architecture.train_flops_per_token`) for this loaded model: LoRA, remat, attention."""
    from tunix.sft import utils as sft_utils

    from tunix_pipeline.planning.architecture import from_tunix_config

    mode = "lora" if sft_utils.is_lora_enabled(model) else "full"
    return from_tunix_config(model.config).train_flops_per_token(seq_len, mode, remat)


def _throughput_hooks(tokens_per_step: int, flops_per_step: float, peak_flops: float | None, devices: int):
    from tunix.sft import hooks

    class Throughput(hooks.TrainingHooks):
        """Step time, tokens/s (padded: the work the devices do), MFU and device memory, per step."""

        def __init__(self):
            self.last, self.progress = None, None

        def on_train_start(self, trainer):
            self.last = None
            self.progress = Progress(trainer.config.pbar_description, trainer.config.max_steps, trainer.train_steps)

        def on_train_step_end(self, trainer, train_step, train_loss):
            now = time.perf_counter()
            if self.last is not None:
                seconds = now - self.last
                metrics = {"step_time": seconds, "tokens_per_sec": tokens_per_step / seconds}
                if peak_flops:
                    metrics["mfu"] = flops_per_step / seconds / (peak_flops * devices)
                stats = jax.local_devices()[0].memory_stats() or {}
                if "bytes_in_use" in stats:
                    metrics["device_memory_gb"] = stats["bytes_in_use"] / 1e9
                for name, value in metrics.items():
                    trainer.metrics_logger.log(trainer.metrics_prefix, name, value, "train", train_step)
            loss = None if train_loss is None else float(train_loss)  # written a step late: already on the host
            self.progress.update(train_step, loss, metrics["tokens_per_sec"] if self.last is not None else None)
            self.last = now

        def on_train_end(self, trainer): ...
        def on_train_step_start(self, trainer): ...
        def on_eval_step_start(self, trainer): ...
        def on_eval_step_end(self, trainer, eval_loss): ...

    return Throughput()


# ---------------------------------------------------------------- compiling the step
# XLA:CPU's default hands every dot to YNNPACK on its own ("individual dot") and
# then lays the backward pass out with transposing copies of each MLP activation
# gradient (slow strided loops). Letting YNNPACK fuse dots with their neighbours
# instead ran the CPU train step ~1.35x faster in benchmarks/cpu_sft.py with
# bitwise-equal results. Only XLA:CPU reads these options.
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE",
}
_supported_options: dict[str, bool] = {}


def step_compiler_options() -> dict:
    """`CPU_COMPILER_OPTIONS` when JAX runs on the CPU and this XLA accepts them, else none."""
    if jax.default_backend() != "cpu" or not CPU_COMPILER_OPTIONS:
        return {}
    key = repr(sorted(CPU_COMPILER_OPTIONS.items()))
    if key not in _supported_options:
        try:  # an XLA that does not know an option refuses to compile with it
            jax.jit(jnp.dot, compiler_options=CPU_COMPILER_OPTIONS).lower(jnp.ones((2, 2)), jnp.ones((2, 2))).compile()
            _supported_options[key] = True
        except Exception as err:  # noqa: BLE001 - any refusal means: compile without them
            log.info("XLA:CPU options %s not supported here (%s); compiling without them", CPU_COMPILER_OPTIONS, err)
            _supported_options[key] = False
    return dict(CPU_COMPILER_OPTIONS) if _supported_options[key] else {}


class _jit_with_options:
    """Within this block, `jax.jit` (which `nnx.jit` calls) compiles with `options`.

    Tunix builds its train and eval steps with `nnx.jit`, which takes no compiler
    options; this passes ours to the `jax.jit` underneath, only while they are built
    (a moment, on the thread that builds the trainer's steps).
    """

    def __init__(self, options: dict):
        self.options, self.original = options, None

    def __enter__(self):
        if self.options:
            self.original = original = jax.jit
            options = self.options

            def jit(*args, **kwargs):
                kwargs.setdefault("compiler_options", options)
                return original(*args, **kwargs)

            jax.jit = jit
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            jax.jit = self.original


@functools.cache
def trainer_class(base=None):
    """`base` (Tunix's PeftTrainer or a subclass such as DPOTrainer) whose jitted steps get `step_compiler_options()`
    and whose progress bar shows tokens/s."""
    from tunix.sft import peft_trainer

    class Trainer(base or peft_trainer.PeftTrainer):
        """A Tunix trainer whose jitted steps get `step_compiler_options()`, and whose batches (each process's
        rows) become global arrays on `data_mesh` before Tunix's own `shard_input` sees them (`shard_rows`)."""

        data_mesh = None

        def _prepare_inputs(self, batch):
            if self.data_mesh is not None and jax.process_count() > 1 and isinstance(batch, dict):
                batch = shard_rows(batch, self.data_mesh)
            return super()._prepare_inputs(batch)

        @property
        def _tqdm_train_metrics(self):
            # Tunix's bar in a terminal or notebook shows tokens/s too, once our throughput hook has logged it
            names = super()._tqdm_train_metrics
            if self.metrics_logger.metric_exists(self.metrics_prefix, "tokens_per_sec", "train"):
                names = [*names, "tokens_per_sec"]
            return names

        def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False):
            building = not skip_jit and self._jitted_train_step_fn is None
            with _jit_with_options(step_compiler_options() if building else {}):
                return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)

    return Trainer


def _trainer(model, sft: SftParams, mesh, options, ckpt_dir: epath.Path):
    """A PeftTrainer restored from the latest good checkpoint (corrupt ones are set aside)."""
    from tunix.sft import metrics_logger, peft_trainer

    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=sft.eval_every or sft.max_steps + 1,
        max_steps=sft.max_steps,
        gradient_accumulation_steps=sft.gradient_accumulation_steps if sft.gradient_accumulation_steps > 1 else None,
        checkpoint_root_directory=str(ckpt_dir),
        checkpointing_options=checkpoints.options(sft.checkpoint_every, sft.keep_checkpoints),
        data_sharding_axis=BATCH_AXES,
        pbar_description="sft",
    )
    trainer = checkpoints.restored_trainer(
        lambda: trainer_class()(model, make_optimizer(sft.optim), config, metrics_logger=metrics_logger.MetricsLogger(options)),
        ckpt_dir,
    )
    trainer.data_mesh = mesh
    return trainer


# ---------------------------------------------------------------- the run
def train(
    model,
    train_rows: pd.DataFrame,
    eval_rows: pd.DataFrame,
    sft: SftParams,
    mesh: jax.sharding.Mesh,
    metrics_backends: list | None = None,
    peak_flops_per_device: float | None = None,
) -> dict:
    """Trains `model` in place; resumes from the latest checkpoint in `sft.checkpoint_dir`."""
    batch_size = global_batch_size(sft, mesh)
    local = process_rows(mesh, batch_size)
    seq_len = len(train_rows["input_tokens"].iloc[0])
    ckpt_dir = storage_path(sft.checkpoint_dir, "sft.checkpoint_dir")  # a gs:// URI reaches Orbax as it is
    options = checkpoints.logger_options(ckpt_dir, metrics_backends)
    feed = BatchFeed(train_rows, batch_size, sft.seed, local)
    sft = sft.steps_for(len(train_rows), batch_size)  # sft.epochs -> max_steps, now that the rows are known
    if sft.eval_every and len(eval_rows):
        feed.with_eval(eval_batches(eval_rows, batch_size, local))
    if sft.time_budget_hours:
        feed.with_deadline(_process_start() + sft.time_budget_hours * 3600, save_seconds=_save_seconds_guess(model))
    flops_per_step = batch_size * seq_len * train_flops_per_token(model, seq_len, sft.remat)

    from tunix_pipeline.tracking import scalar_listeners_scope

    with scalar_listeners_scope(), mesh:
        trainer = _trainer(model, sft, mesh, options, ckpt_dir)
        trainer.with_loss_fn(loss_fn_for(sft)).with_gen_model_input_fn(model_inputs)
        trainer.with_training_hooks(
            _throughput_hooks(batch_size * seq_len, flops_per_step, peak_flops_per_device, mesh.devices.size)
        )
        trainer.with_data_hooks(feed)
        start_step = trainer.train_steps
        history = checkpoints.load_history(ckpt_dir, start_step)
        checkpoints.record_history_with_checkpoints(trainer, ckpt_dir, history, start_step)
        if start_step:
            log.info("resuming SFT from checkpoint step %d in %s", start_step, ckpt_dir)
        started = time.perf_counter()
        with _stop_on_sigterm(feed):
            trainer.train([], feed._eval or None)  # batches come from the data hook
        seconds = time.perf_counter() - started
        end_step = trainer.train_steps

    history = history + checkpoints.new_losses(trainer, start_step)
    checkpoints.save_history(ckpt_dir, history)
    # multi-host: Orbax syncs every process before each save and after its finalisation, and the
    # in-training evaluation is one SPMD program; this barrier lets no process go on to the next
    # stage (evaluate, which restores the checkpoints) before process 0 has written the history too
    _sync("sft_end")
    if feed.stop_reason == "SIGTERM":
        raise TrainingInterrupted(
            f"SIGTERM: saved a checkpoint at step {end_step} in {ckpt_dir}; "
            "rerun the same command to resume from it"
        )
    if feed.stop_reason:
        log.warning("stopped at step %d of %d to save within the %s h session budget; rerun to continue",
                    end_step, sft.max_steps, sft.time_budget_hours)
    tokens_per_sec = checkpoints.metric_history(trainer.metrics_logger, trainer.metrics_prefix, "tokens_per_sec")
    return {
        "checkpoint_dir": str(ckpt_dir),
        "latest_step": end_step,
        "resumed_from_step": start_step,
        "steps_this_run": end_step - start_step,
        "stopped_early": feed.stop_reason,
        "global_batch_size": batch_size * sft.gradient_accumulation_steps,
        "micro_batch_size": batch_size,
        "sequence_length": seq_len,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "loss_history": history,
        "train_seconds": seconds,
        "median_tokens_per_sec": float(np.median(tokens_per_sec)) if len(tokens_per_sec) else None,
    }


class _stop_on_sigterm:
    """SIGTERM (how preemption arrives) ends the run at the next step, with a checkpoint."""

    def __init__(self, feed: BatchFeed):
        self.feed, self.previous = feed, None

    def __enter__(self):
        try:
            self.previous = signal.signal(signal.SIGTERM, lambda *_: self.feed.stop("SIGTERM"))
        except ValueError:  # not the main thread: leave signals alone
            self.previous = None
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _save_seconds_guess(model, bytes_per_second: float = 200e6) -> float:
    """Until a save has been timed: the checkpointed state (weights or adapters, and Adam's two moments) at 200 MB/s."""
    from tunix.sft import utils as sft_utils

    saved = nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param
    return 1.0 + 3 * sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, saved))) / bytes_per_second


def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()

