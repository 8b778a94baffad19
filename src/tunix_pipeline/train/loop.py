"""The run loop every training stage shares, around Tunix's trainers and through their own seams:
- batches that are a pure function of the step (`BatchFeed`, a Tunix data hook): a resumed run sees exactly
  the batches an uninterrupted run would (Tunix itself replays the iterator and skips), each process reads only
  its share, and SIGTERM, Ctrl-C (SIGINT) or the session budget (`StepClock`) end the run with a checkpoint;
- the trainer restored from the latest good checkpoint (a corrupt latest one is set aside for the previous one,
  in `checkpoints`), run to its last step (`fit`) and summed up (`end_run`): steps, useful tokens/s, time;
- the optimizer every training stage builds (`make_optimizer`): schedule, weight decay, clipping.
"""

from __future__ import annotations

import logging
import signal
import time

import jax
import numpy as np
import optax
import pandas as pd
import psutil
from etils import epath
from flax import nnx
from tunix.sft import utils as sft_utils

from tunix_pipeline import upstream
from tunix_pipeline.config import CheckpointSettings, OptimizerSettings
from tunix_pipeline.core.errors import STOP_SIGNALS, TrainingInterrupted
from tunix_pipeline.core.processes import barrier
from tunix_pipeline.core.runtime import BATCH_AXES, MeshError
from tunix_pipeline.data.tokenization import token_arrays
from tunix_pipeline.train import checkpoints

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- data
class BatchFeed:
    """Batch `i` of a run is a pure function of `i`: seeded epochs of full batches.

    A Tunix `DataHooks`: the trainer asks for the batch of its current step, so
    a resumed run continues exactly where an uninterrupted run would be. It also
    ends the run (returns None, after which Tunix saves a last checkpoint) on
    a stop signal or when the session budget leaves only the time to save.
    """

    def __init__(self, rows: pd.DataFrame, batch_size: int, seed: int, local: slice | None = None, arrays=None,
                 row_tokens: tuple[int, np.ndarray] | None = None, micro_batches: int = 1):
        self.arrays = token_arrays(rows) if arrays is None else arrays  # arrays: other columns (preference pairs)
        # (token slots of a row, non-padding tokens of each row): what a step computes, and how much of it counts
        self.row_tokens = row_tokens or row_token_counts(self.arrays)
        self.micro_batches = micro_batches  # batches per optimizer step (gradient accumulation)
        self.n = len(rows)
        if self.n < batch_size:
            raise MeshError(
                f"{self.n} training rows cannot fill one global batch of {batch_size}; "
                "lower `sft.per_device_batch_size` or add data"
            )
        self.batch_size, self.seed = batch_size, seed
        self.local = local or slice(0, batch_size)
        self.per_epoch = self.n // batch_size  # the remainder of each epoch is dropped: one shape, one compile
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its shuffled rows): one permutation an epoch
        self.stop_reason: str | None = None
        self.evals: list[dict] = []  # the in-training evaluation's batches
        self._eval_iter = None
        self._deadline = None
        self._clock = StepClock()

    def rows_of(self, step: int) -> np.ndarray:
        """Indices of the global batch `step` (every process's rows)."""
        epoch, k = divmod(step, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        return self._order[1][k * self.batch_size : (k + 1) * self.batch_size]

    def batch(self, step: int) -> dict:
        idx = self.rows_of(step)[self.local]
        return {name: a[idx] for name, a in self.arrays.items()}

    def step_tokens(self, train_step: int) -> tuple[int, int]:
        """(token slots, non-padding tokens) of optimizer step `train_step` (1-based, as Tunix's hooks number
        steps): every micro-batch of it, every process's rows."""
        slots, useful = self.row_tokens
        batches = range((train_step - 1) * self.micro_batches, train_step * self.micro_batches)
        return slots * self.batch_size * len(batches), int(sum(useful[self.rows_of(i)].sum() for i in batches))

    def stop(self, reason: str) -> None:
        self.stop_reason = reason

    @property
    def interrupted(self) -> bool:
        """A signal stopped the run (not the session budget): nothing more is computed after the save."""
        return self.stop_reason in STOP_SIGNALS

    def with_budget(self, hours: float | None, model) -> BatchFeed:
        """Ends the run with time left to save `model`'s checkpoint, `hours` after this process started."""
        if hours:
            self._deadline = process_start() + hours * 3600
            self._clock.save_seconds = save_seconds_guess(model)
        return self

    def with_eval(self, batches: list[dict]) -> BatchFeed:
        self.evals = batches
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
            self._eval_iter = iter(self.evals)
        batch = next(self._eval_iter, None)
        if batch is None:
            self._eval_iter = None  # ready for the next evaluation
        return batch


def row_token_counts(arrays: dict) -> tuple[int, np.ndarray]:
    """(token slots of a row, non-padding tokens of each row) of tokenized rows: a token is useful where it has a
    segment id, i.e. it is real input (with packing, every packed example's tokens)."""
    segments = arrays["segment_ids"]
    return segments.shape[1], (segments != 0).sum(axis=1)


def examples_per_row(arrays: dict) -> float:
    """Training examples a token row holds on average: its segments (several in a packed row)."""
    return float(np.mean([len(np.unique(row[row != 0])) for row in arrays["segment_ids"]]))


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


class stop_on_signals:
    """SIGTERM (how preemption arrives) or Ctrl-C (SIGINT) ends the run at the next step, with a checkpoint, through
    `feed.stop`; a second Ctrl-C stops at once (Orbax finalizes a checkpoint atomically: a half-written one is
    ignored at the next start)."""

    def __init__(self, feed):
        self.feed, self.previous = feed, {}

    def _stop(self, signum, frame) -> None:
        if self.feed.stop_reason is not None:  # already stopping: a second Ctrl-C stops at once
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        name = signal.Signals(signum).name
        log.warning("%s: stopping after this step and saving a checkpoint%s", name,
                    " (Ctrl-C again stops at once, without it)" if signum == signal.SIGINT else "")
        self.feed.stop(name)

    def __enter__(self):
        for sig in STOP_SIGNALS.values():
            try:
                self.previous[sig] = signal.signal(sig, self._stop)
            except ValueError:  # not the main thread: leave signals alone
                break
        return self

    def __exit__(self, *exc):
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        self.previous = {}


def save_seconds_guess(model, bytes_per_second: float = 200e6) -> float:
    """Until a save has been timed: the checkpointed state (weights or adapters, and Adam's two moments) at 200 MB/s."""
    saved = nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param
    return 1.0 + 3 * sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, saved))) / bytes_per_second


def process_start() -> float:
    return psutil.Process().create_time()


# ---------------------------------------------------------------- the run loop (SFT and preference)
def fit(trainer, feed: BatchFeed, ckpt_dir: epath.Path, stage: str, max_steps: int) -> dict:
    """Trains a restored `trainer` to `max_steps` on `feed`'s batches, keeping the loss history beside the
    checkpoints. Returns the run's figures; `history` holds every step's loss since step 0, `train_seconds` every
    run's training time to the latest step."""
    start_step = trainer.train_steps
    history = checkpoints.load_history(ckpt_dir, start_step)
    clock = checkpoints.TrainClock(ckpt_dir, start_step)

    def record(step: int) -> None:
        checkpoints.save_history(ckpt_dir, history + checkpoints.new_losses(trainer, start_step))
        clock.save(step)

    upstream.record_history_with_checkpoints(trainer, record)
    if start_step:
        log.info("resuming %s from checkpoint step %d in %s", stage, start_step, ckpt_dir)
    if start_step < max_steps:
        with stop_on_signals(feed):
            trainer.train([], feed.evals or None)  # batches come from the data hook
        clock.save(trainer.train_steps)
    else:
        trainer.close()
    return {
        "checkpoint_dir": str(ckpt_dir),
        "latest_step": trainer.train_steps,
        "resumed_from_step": start_step,
        "steps_this_run": trainer.train_steps - start_step,
        "stopped_early": feed.stop_reason,
        "history": history,
        "train_seconds": clock.total(),  # every run's, to the latest step
        "seconds_this_run": clock.this_run(),
        **throughput_summary(trainer, feed, start_step),
    }


def throughput_summary(trainer, feed: BatchFeed, start_step: int) -> dict:
    """The run's speed: the median of its steps' rates (`progress.step_throughput`; MFU where a peak was known),
    and the share of padding in every step it trained."""
    def median(name: str) -> float | None:
        values = checkpoints.metric_history(trainer.metrics_logger, trainer.metrics_prefix, name)
        return float(np.median(values)) if len(values) else None

    steps = [feed.step_tokens(s) for s in range(start_step + 1, trainer.train_steps + 1)]
    slots = sum(slots for slots, _ in steps)
    return {
        "median_tokens_per_sec": median("tokens_per_sec"),  # every token slot, padding included
        "median_useful_tokens_per_sec": median("useful_tokens_per_sec"),
        "median_mfu": median("mfu"),
        "median_useful_mfu": median("useful_mfu"),
        "padding_fraction": 1 - sum(useful for _, useful in steps) / slots if slots else None,
    }


def end_run(feed: BatchFeed, stage: str, figures: dict, max_steps: int, budget_hours: float | None) -> None:
    """After the history is saved: every process waits for process 0 (the next stage restores these
    checkpoints); a stop signal becomes `TrainingInterrupted`, a spent session budget a warning."""
    barrier(f"{stage}_end")
    if feed.interrupted:
        raise TrainingInterrupted(feed.stop_reason, figures["latest_step"], figures["checkpoint_dir"])
    if feed.stop_reason:
        log.warning("stopped %s at step %d of %d to save within the %s h session budget (checkpoint in %s); "
                    "rerun the same command to continue", stage, figures["latest_step"], max_steps, budget_hours,
                    figures["checkpoint_dir"])


# ---------------------------------------------------------------- the optimizer of every training stage
# (SFT, preference, GRPO), from the `OptimizerSettings` keys each stage's section has (`sft.learning_rate`,
# `grpo.weight_decay`, ...): a change to the optimizer (the schedule, what decays) is made here once
def learning_rate_schedule(opt: OptimizerSettings, max_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine (to 10% of the peak), linear (to 0) or constant, over `max_steps`."""
    warmup = optax.linear_schedule(0.0, opt.learning_rate, opt.warmup_steps)
    rest = max_steps - opt.warmup_steps
    if opt.schedule == "cosine":
        after = optax.cosine_decay_schedule(opt.learning_rate, rest, alpha=0.1)
    elif opt.schedule == "linear":
        after = optax.linear_schedule(opt.learning_rate, 0.0, rest)
    else:
        after = optax.constant_schedule(opt.learning_rate)
    return optax.join_schedules([warmup, after], [opt.warmup_steps]) if opt.warmup_steps else after


def decay_mask(params):
    """Weight decay on matrices only: not on norms, biases or other vectors."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(opt: OptimizerSettings, max_steps: int) -> optax.GradientTransformation:
    def build(learning_rate):
        if opt.optimizer == "adamw":
            core = optax.adamw(learning_rate, weight_decay=opt.weight_decay, mask=decay_mask, mu_dtype=opt.mu_dtype)
        else:
            core = optax.adafactor(learning_rate, weight_decay_rate=opt.weight_decay or None, weight_decay_mask=decay_mask)
        if opt.max_grad_norm is None:
            return core
        return optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), core)

    # inject_hyperparams lets Tunix read and log the learning rate every step
    return optax.inject_hyperparams(build)(learning_rate=learning_rate_schedule(opt, max_steps))


# ---------------------------------------------------------------- a Tunix trainer, as SFT and preference set it up
def trainer_config(params: CheckpointSettings, max_steps: int, ckpt_dir: epath.Path, description: str,
                   eval_every: int | None = None, dev=None) -> dict:
    """The fields of a Tunix trainer's config that every stage on Tunix's PeftTrainer sets alike: its steps, no
    evaluation unless asked, Orbax checkpoints (also at `dev`'s steps, keeping its best), the batch's sharding and
    the progress bar's label."""
    return dict(
        eval_every_n_steps=eval_every or max_steps + 1,
        max_steps=max_steps,
        checkpoint_root_directory=str(ckpt_dir),
        checkpointing_options=checkpoints.options(params.checkpoint_every, params.keep_checkpoints, dev=dev),
        data_sharding_axis=BATCH_AXES,
        pbar_description=description,
    )


def restored_trainer(build, optimizer_settings: OptimizerSettings, max_steps: int, ckpt_dir: epath.Path, mesh):
    """`build(optimizer)`'s trainer, restored from the latest good checkpoint (corrupt ones are set aside), feeding
    batches sharded over `mesh`."""
    trainer = checkpoints.restored_trainer(lambda: build(make_optimizer(optimizer_settings, max_steps)), ckpt_dir)
    trainer.data_mesh = mesh
    return trainer


def frozen_copy(model):
    """A second model with the same weights that later updates of `model` do not touch (arrays shared)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
