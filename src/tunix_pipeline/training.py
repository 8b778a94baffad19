"""Supervised fine-tuning with Tunix's `PeftTrainer` on a device mesh.

What we add around the trainer, through its own seams:
- a completion-only loss on integer labels (Tunix's default one-hot encodes
  the whole vocabulary: 256k wide for Gemma), optionally chunked, with packed
  rows attending only within their own example;
- batches that are a pure function of the step (`BatchFeed`, a Tunix data
  hook): a resumed run sees exactly the batches an uninterrupted run would
  (Tunix itself replays the iterator and skips), each process reads only its
  share, and SIGTERM or the session budget end the run with a checkpoint;
- per-step metrics to MLflow through a Tunix metrics backend, with step time,
  tokens/s, MFU and device memory;
- a loss history kept beside the checkpoints, so a resumed run reports the
  whole curve; a corrupt latest checkpoint is set aside for the previous one.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
from etils import epath
from flax import nnx

from tunix_pipeline.config import RuntimeParams, SftParams
from tunix_pipeline.errors import UserError
from tunix_pipeline.models.errors import ModelError
from tunix_pipeline.paths import storage_path
from tunix_pipeline.runtime import barrier as _sync
from tunix_pipeline.tokenization import token_arrays

log = logging.getLogger(__name__)
HISTORY_FILE = "loss_history.json"
MESH_AXES = ("data", "fsdp", "tp")
# the batch dimension is split over every data-parallel axis
BATCH_AXES = (("data", "fsdp"),)


class MeshError(UserError, ValueError):
    """A mesh or batch size that does not fit the devices."""


class CheckpointError(UserError, FileNotFoundError):
    """A checkpoint a stage needs is missing or does not fit the model."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM (preemption) stopped training after a checkpoint was saved."""


# ---------------------------------------------------------------- mesh
def make_mesh(runtime: RuntimeParams, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tp) mesh over all devices; every axis exists (Tunix's shardings name fsdp and tp)."""
    devices = devices if devices is not None else jax.devices()
    if runtime.mesh == "auto":
        shape = {"data": 1, "fsdp": len(devices), "tp": 1}
    else:
        shape = {axis: runtime.mesh.get(axis, 1) for axis in MESH_AXES}
    size = int(np.prod(list(shape.values())))
    if size != len(devices):
        # a pod slice seen from one worker: its processes were not joined into one JAX runtime
        pod = size > len(devices) and jax.process_count() == 1
        raise MeshError(
            f"runtime.mesh {shape} needs {size} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); set `runtime.mesh: auto` or sizes whose product is {len(devices)}"
            + ("; on a multi-host slice start every worker with `--params runtime.distributed=auto`" if pod else "")
        )
    return jax.make_mesh(
        tuple(shape.values()), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
    )


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def global_batch_size(sft: SftParams, mesh: jax.sharding.Mesh) -> int:
    """Rows per micro-batch: per-device batch times the data-parallel devices (tp devices share rows)."""
    return sft.per_device_batch_size * data_parallel_size(mesh)


def process_rows(mesh: jax.sharding.Mesh, batch_size: int) -> slice:
    """The rows of each global batch that this process feeds to its own devices."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*BATCH_AXES))
    spans = sorted(
        {(s[0].start or 0, s[0].stop or batch_size) for s in sharding.addressable_devices_indices_map((batch_size,)).values()}
    )
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise MeshError(f"this process's devices hold non-contiguous rows {spans} of the batch")
    return slice(start, stop)


def shard_rows(batch: dict, mesh: jax.sharding.Mesh) -> dict:
    """This process's rows of a global batch (`process_rows`) as global arrays split over the data axes.

    Not Tunix's `shard_input`: it checks the divisibility on the process's own rows, and where they
    do not divide over the data-parallel devices (2 rows a process, 4 devices) it replicates them,
    so each process computes on its own rows as if they were the whole batch.
    """
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*BATCH_AXES))
    return {k: v if isinstance(v, jax.Array) and not v.is_fully_addressable  # already global
            else jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


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


# ---------------------------------------------------------------- model inputs and loss
def model_inputs(batch: dict) -> dict:
    """Per-example positions and a causal mask that never crosses examples (segments) or padding."""
    segments = batch["segment_ids"]
    same = segments[:, :, None] == segments[:, None, :]
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    return {
        "input_tokens": batch["input_tokens"],
        "loss_mask": batch["loss_mask"],
        "positions": batch["positions"],
        "attention_mask": same & causal[None] & (segments[:, None, :] > 0),
    }


def _as_dtype(model, dtype):
    """`model` with its floating-point weights cast (differentiably) to `dtype`."""
    graphdef, state = nnx.split(model)
    cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    return nnx.merge(graphdef, cast)


def token_nll(model, input_tokens, loss_mask, positions, attention_mask, chunk_size=None, compute_dtype=None):
    """(sum of next-token NLL over completion tokens, number of such tokens)."""
    if compute_dtype is not None:
        model = _as_dtype(model, compute_dtype)
    logits, _ = model(input_tokens, positions, None, attention_mask)
    logits, targets = logits[:, :-1], input_tokens[:, 1:]
    mask = loss_mask[:, 1:].astype(jnp.float32)
    if chunk_size is None or chunk_size >= logits.shape[1]:
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        return jnp.sum(nll * mask), jnp.sum(mask)

    # chunks of positions, each recomputed in the backward pass: the fp32 softmax
    # over the vocabulary never exists for the whole sequence at once
    pad = -logits.shape[1] % chunk_size
    logits = jnp.pad(logits, ((0, 0), (0, pad), (0, 0)))
    targets, mask = jnp.pad(targets, ((0, 0), (0, pad))), jnp.pad(mask, ((0, 0), (0, pad)))
    b, n = logits.shape[0], logits.shape[1] // chunk_size

    @jax.checkpoint
    def chunk_nll(args):
        lg, tg, mk = args
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(lg.astype(jnp.float32), tg) * mk)

    def split(x):
        return jnp.moveaxis(x.reshape(b, n, chunk_size, *x.shape[2:]), 1, 0)

    return jnp.sum(jax.lax.map(chunk_nll, (split(logits), split(targets), split(mask)))), jnp.sum(mask)


def completion_loss(model, input_tokens, loss_mask, positions, attention_mask, chunk_size=None, compute_dtype=None):
    """Mean NLL over completion tokens, from integer labels (no one-hot)."""
    total, count = token_nll(model, input_tokens, loss_mask, positions, attention_mask, chunk_size, compute_dtype)
    return total / jnp.maximum(count, 1.0)


def loss_fn_for(sft: SftParams):
    dtype = jnp.dtype(sft.compute_dtype) if sft.compute_dtype else None

    def loss(model, input_tokens, loss_mask, positions, attention_mask):
        return completion_loss(model, input_tokens, loss_mask, positions, attention_mask, sft.loss_chunk_size, dtype)

    return loss


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


# ---------------------------------------------------------------- optimizer
def learning_rate_schedule(sft: SftParams) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0, sft.learning_rate, sft.warmup_steps)
    rest = sft.max_steps - sft.warmup_steps
    if sft.schedule == "cosine":
        after = optax.cosine_decay_schedule(sft.learning_rate, rest, alpha=0.1)
    elif sft.schedule == "linear":
        after = optax.linear_schedule(sft.learning_rate, 0.0, rest)
    else:
        after = optax.constant_schedule(sft.learning_rate)
    return optax.join_schedules([warmup, after], [sft.warmup_steps]) if sft.warmup_steps else after


def decay_mask(params):
    """Weight decay on matrices only: not on norms, biases or other vectors."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(sft: SftParams) -> optax.GradientTransformation:
    def build(learning_rate):
        if sft.optimizer == "adamw":
            core = optax.adamw(learning_rate, weight_decay=sft.weight_decay, mask=decay_mask)
        else:
            core = optax.adafactor(learning_rate, weight_decay_rate=sft.weight_decay or None, weight_decay_mask=decay_mask)
        if sft.max_grad_norm is None:
            return core
        return optax.chain(optax.clip_by_global_norm(sft.max_grad_norm), core)

    # inject_hyperparams lets Tunix read and log the learning rate every step
    return optax.inject_hyperparams(build)(learning_rate=learning_rate_schedule(sft))


# ---------------------------------------------------------------- metrics
def train_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: 6 x parameters (forward + backward) + attention, as MaxText counts them."""
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    cfg = model.config
    return 6.0 * params + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def _throughput_hooks(tokens_per_step: int, flops_per_step: float, peak_flops: float | None, devices: int):
    from tunix.sft import hooks

    class Throughput(hooks.TrainingHooks):
        """Step time, tokens/s (padded: the work the devices do), MFU and device memory, per step."""

        def __init__(self):
            self.last = None

        def on_train_start(self, trainer):
            self.last = None

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
            self.last = now

        def on_train_end(self, trainer): ...
        def on_train_step_start(self, trainer): ...
        def on_eval_step_start(self, trainer): ...
        def on_eval_step_end(self, trainer, eval_loss): ...

    return Throughput()


# ---------------------------------------------------------------- checkpoints
def _checkpoint_options(sft: SftParams):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManagerOptions(
        # every N steps (and on a preemption notice), without Orbax's extra save at the first step;
        # the trainer always saves the last step when it stops
        save_decision_policy=ocp.checkpoint_managers.AnySavePolicy(
            [
                ocp.checkpoint_managers.FixedIntervalPolicy(sft.checkpoint_every),
                ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
            ]
        ),
        max_to_keep=sft.keep_checkpoints,
        enable_async_checkpointing=True,
    )


def _set_aside(ckpt_dir: epath.Path, step: int, err: Exception) -> None:
    target = ckpt_dir / f"{step}.corrupt"
    log.warning("checkpoint %s/%d cannot be restored (%s); moved to %s, resuming from the one before",
                ckpt_dir, step, err, target)
    if jax.process_index() == 0:
        (ckpt_dir / str(step)).rename(target)
    _sync(f"set_aside_{step}")


def _latest_step(ckpt_dir: epath.Path) -> int | None:
    steps = [int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit() and p.is_dir()]
    return max(steps) if steps else None


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
    """`base` (Tunix's PeftTrainer or a subclass such as DPOTrainer) whose jitted steps get `step_compiler_options()`."""
    from tunix.sft import peft_trainer

    class Trainer(base or peft_trainer.PeftTrainer):
        """A Tunix trainer whose jitted steps get `step_compiler_options()`, and whose batches (each process's
        rows) become global arrays on `data_mesh` before Tunix's own `shard_input` sees them (`shard_rows`)."""

        data_mesh = None

        def _prepare_inputs(self, batch):
            if self.data_mesh is not None and jax.process_count() > 1 and isinstance(batch, dict):
                batch = shard_rows(batch, self.data_mesh)
            return super()._prepare_inputs(batch)

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
        checkpointing_options=_checkpoint_options(sft),
        data_sharding_axis=BATCH_AXES,
        pbar_description="sft",
    )
    trainer = restored_trainer(
        lambda: trainer_class()(model, make_optimizer(sft), config, metrics_logger=metrics_logger.MetricsLogger(options)),
        ckpt_dir,
    )
    trainer.data_mesh = mesh
    return trainer


def restored_trainer(build, ckpt_dir: epath.Path):
    """`build()`, a trainer that restores the latest good checkpoint of `ckpt_dir` (corrupt ones are set aside)."""
    while True:
        try:
            return build()
        except Exception as err:  # Orbax raises many types for unreadable files
            step = _latest_step(ckpt_dir)
            if step is None:
                raise
            _set_aside(ckpt_dir, step, err)


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
    from tunix.sft import metrics_logger

    batch_size = global_batch_size(sft, mesh)
    local = process_rows(mesh, batch_size)
    seq_len = len(train_rows["input_tokens"].iloc[0])
    ckpt_dir = storage_path(sft.checkpoint_dir, "sft.checkpoint_dir")  # a gs:// URI reaches Orbax as it is
    options = None
    if metrics_backends:
        options = metrics_logger.MetricsLoggerOptions(
            log_dir=str(ckpt_dir / "logs"), backend_kwargs={"custom_backend": metrics_backends}
        )
    feed = BatchFeed(train_rows, batch_size, sft.seed, local)
    sft = sft.steps_for(len(train_rows), batch_size)  # sft.epochs -> max_steps, now that the rows are known
    if sft.eval_every and len(eval_rows):
        feed.with_eval(eval_batches(eval_rows, batch_size, local))
    if sft.time_budget_hours:
        feed.with_deadline(_process_start() + sft.time_budget_hours * 3600, save_seconds=_save_seconds_guess(model))
    flops_per_step = batch_size * seq_len * train_flops_per_token(model, seq_len)

    from tunix_pipeline.tracking import scalar_listeners_scope

    with scalar_listeners_scope(), mesh:
        trainer = _trainer(model, sft, mesh, options, ckpt_dir)
        trainer.with_loss_fn(loss_fn_for(sft)).with_gen_model_input_fn(model_inputs)
        trainer.with_training_hooks(
            _throughput_hooks(batch_size * seq_len, flops_per_step, peak_flops_per_device, mesh.devices.size)
        )
        trainer.with_data_hooks(feed)
        start_step = trainer.train_steps
        history = load_history(ckpt_dir, start_step)
        _record_history_with_checkpoints(trainer, ckpt_dir, history, start_step)
        if start_step:
            log.info("resuming SFT from checkpoint step %d in %s", start_step, ckpt_dir)
        started = time.perf_counter()
        with _stop_on_sigterm(feed):
            trainer.train([], feed._eval or None)  # batches come from the data hook
        seconds = time.perf_counter() - started
        end_step = trainer.train_steps

    history = history + _new_losses(trainer, start_step)
    save_history(ckpt_dir, history)
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
    tokens_per_sec = _history_of(trainer, "tokens_per_sec")
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


def _new_losses(trainer, start_step: int) -> list[dict]:
    """This run's losses so far, with the step Tunix has not written yet (it writes each one a step late)."""
    losses = list(_history_of(trainer, "loss"))
    pending = getattr(trainer, "_prev_buffered_train_metrics", None)
    if pending is not None:
        losses.append(float(pending.loss))
    return [{"step": start_step + i + 1, "loss": float(v)} for i, v in enumerate(losses)]


def _record_history_with_checkpoints(trainer, ckpt_dir: epath.Path, history: list[dict], start_step: int) -> None:
    """Writes the loss history whenever a checkpoint is saved, so a killed run's curve survives with it."""
    manager = trainer.checkpoint_manager
    save = manager.save

    def save_and_record(step, *args, **kwargs):
        saved = save(step, *args, **kwargs)
        if saved:
            save_history(ckpt_dir, history + _new_losses(trainer, start_step))
        return saved

    manager.save = save_and_record


def _history_of(trainer, name: str) -> np.ndarray:
    prefix = trainer.metrics_prefix  # "" for SFT (train/loss), the stage's own for the others
    if not trainer.metrics_logger.metric_exists(prefix, name, "train"):
        return np.array([])
    return np.asarray(trainer.metrics_logger.get_metric_history(prefix, name, "train"), dtype=np.float64).ravel()


def load_history(ckpt_dir: epath.Path, upto_step: int, name: str = HISTORY_FILE) -> list[dict]:
    """The per-step history saved beside the checkpoints, up to the restored step."""
    path = ckpt_dir / name
    if not upto_step or not path.is_file():
        return []
    return [h for h in json.loads(path.read_text()) if h["step"] <= upto_step]


def save_history(ckpt_dir: epath.Path, history: list[dict], name: str = HISTORY_FILE) -> None:
    if jax.process_index() != 0:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / (name + ".tmp")
    tmp.write_text(json.dumps(history))
    tmp.replace(ckpt_dir / name)


def restore_latest(model, checkpoint_dir: str | Path) -> int:
    """Loads the latest SFT checkpoint into `model` (only its adapters when it has LoRA); returns the step (0: none)."""
    from tunix.sft import checkpoint_manager
    from tunix.sft import utils as sft_utils

    manager = checkpoint_manager.CheckpointManager(str(storage_path(checkpoint_dir)))
    try:
        step, _ = manager.maybe_restore(model, restore_only_lora_params=sft_utils.is_lora_enabled(model))
    finally:
        manager.close()
    return step


def restore_required(model, checkpoint_dir: str | Path, stage: str, needed_by: str) -> int:
    """`restore_latest`, for a stage that cannot go on without `stage`'s checkpoint; returns its step."""
    step = restore_latest(model, checkpoint_dir)
    if step == 0:
        raise CheckpointError(f"{needed_by}: no {stage} checkpoint in {checkpoint_dir}; run the `{stage}` pipeline first")
    return step


def start_from(model, parent_dir: str | Path, checkpoint_dir: str | Path) -> dict:
    """Loads the parent run's latest checkpoint into `model` (a new run on its weights, `sft.init_from`).

    Skipped when this run has checkpoints of its own: it was interrupted, and the
    trainer resumes those. Returns the lineage: parent checkpoint, step and MLflow run.
    """
    from tunix_pipeline.tracking import recorded_run

    parent = storage_path(parent_dir, "sft.init_from")
    lineage = {"parent_checkpoint": str(parent), "parent_run_id": recorded_run(parent)}
    if _latest_step(storage_path(checkpoint_dir)) is not None:
        return {**lineage, "parent_step": _latest_step(parent) if parent.is_dir() else None}
    if not parent.is_dir() or _latest_step(parent) is None:
        raise CheckpointError(
            f"sft.init_from: no checkpoint in {parent}; point it at a previous run's sft.checkpoint_dir "
            "(on Kaggle: the attached dataset holding the last session's output)"
        )
    try:
        step = restore_latest(model, parent)
    except Exception as err:  # Orbax names the tree mismatch only deep inside its message
        from tunix.sft import utils as sft_utils

        raise ModelError(
            f"sft.init_from: cannot load {parent} into this model (LoRA: {sft_utils.is_lora_enabled(model)}); "
            f"the parent must have the same model.source and model.lora settings: {err}"
        ) from err
    log.info("starting from %s step %d (a new run: fresh optimizer, step 0)", parent, step)
    return {**lineage, "parent_step": step}
