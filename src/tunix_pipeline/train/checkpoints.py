"""Checkpoints and the per-step history beside them, for SFT, preference and GRPO.

Orbax's save policy of every stage, restoring the latest checkpoint (or saying
which stage to run first), setting a corrupt latest checkpoint aside for the one
before, and a metric history that a resumed run continues, written atomically
beside the checkpoints whenever one is saved.
"""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from tunix.sft import checkpoint_manager, metrics_logger
from tunix.sft import utils as sft_utils

from tunix_pipeline.core.errors import ModelError, UserError
from tunix_pipeline.core.processes import barrier
from tunix_pipeline.upstream import loops_finish_their_tasks, pending_loss

log = logging.getLogger(__name__)
HISTORY_FILE = "loss_history.json"
DEV_CURVE_FILE = "dev_curve.json"  # `dev_eval`'s scores of the dev split, a point per dev step
# the training wall time to each saved step, every run's: apart from the loss history, which is the same bit for
# bit on every process and every rerun, where a time is not
SECONDS_FILE = "train_seconds.json"


class CheckpointError(UserError, FileNotFoundError):
    """A checkpoint a stage needs is missing or does not fit the model."""


# ---------------------------------------------------------------- saving and restoring
def options(every: int, keep: int, last_step: int | None = None, dev=None):
    """Orbax's options: save every `every` steps and on a preemption notice (and at `last_step`, for a
    trainer that does not save its last step itself), keeping the `keep` latest; no extra save at step 1.
    `dev` (a `dev_eval.DevEval`): also save at its dev steps and keep its best step beside the latest."""
    loops_finish_their_tasks()  # a failed restore leaves no reads calling back into a closed loop
    policies = ocp.checkpoint_managers
    steps = [policies.FixedIntervalPolicy(every)]
    if last_step is not None:  # saved inside the loop, so Tunix stores its step metadata with it
        steps.append(policies.SpecificStepsPolicy([last_step]))
    kept = {"max_to_keep": keep}
    if dev is not None:  # the dev score is measured on a saved step, and the best one survives pruning
        steps.append(policies.FixedIntervalPolicy(dev.settings.every))
        kept = {"preservation_policy": policies.AnyPreservationPolicy([policies.LatestN(n=keep), dev.keep])}
    return ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy([*steps, policies.PreemptionCheckpointingPolicy()]),
        enable_async_checkpointing=True,
        # a step half-written when the run stopped (a full disk, a kill) stays `<step>.orbax-checkpoint-tmp`, never
        # a step `latest_step` or Orbax resumes from; removed when the next run opens the folder, so its space is back
        cleanup_tmp_directories=True,
        **kept,
    )


def latest_step(ckpt_dir: epath.Path) -> int | None:
    steps = [int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit() and p.is_dir()]
    return max(steps) if steps else None


def params_dir(checkpoint_dir: epath.Path, step: int) -> epath.Path:
    """The Orbax folder of a checkpoint's weights (only the LoRA adapters in a LoRA run), as Tunix's
    CheckpointManager writes it: what `orbax.checkpoint.StandardCheckpointer().restore` reads in a
    Tunix notebook (docs/restore_with_tunix.md)."""
    return checkpoint_dir / str(step) / "model_params"


def set_aside(ckpt_dir: epath.Path, step: int, err: Exception) -> None:
    target = ckpt_dir / f"{step}.corrupt"
    log.warning("checkpoint %s/%d cannot be restored (%s); moved to %s, resuming from the one before",
                ckpt_dir, step, _first_line(err), target)
    if jax.process_index() == 0:
        (ckpt_dir / str(step)).rename(target)
    barrier(f"set_aside_{step}")


def _first_line(err: Exception) -> str:
    """The gist of a restore error: TensorStore's messages go on with the whole store's spec, dozens of lines."""
    text = str(err).split("\n", 1)[0].split(" See full TensorStore details", 1)[0]
    return f"{type(err).__name__}: {text[:300]}"


def restored_trainer(build, ckpt_dir: epath.Path):
    """`build()`, a trainer that restores the latest good checkpoint of `ckpt_dir` (corrupt ones are set aside)."""
    while True:
        try:
            return build()
        except Exception as err:  # Orbax raises many types for unreadable files
            step = latest_step(ckpt_dir)
            if step is None:
                raise
            set_aside(ckpt_dir, step, err)


def restore_latest(model, checkpoint_dir: epath.Path, step: int | None = None) -> int:
    """Loads the latest checkpoint of `checkpoint_dir` (or the one of `step`) into `model` (only its adapters when it
    has LoRA); returns the step (0: none)."""
    loops_finish_their_tasks()
    manager = checkpoint_manager.CheckpointManager(str(checkpoint_dir))
    try:
        step, _ = manager.maybe_restore(model, step=step, restore_only_lora_params=sft_utils.is_lora_enabled(model))
    finally:
        manager.close()
    return step


def restore_required(model, checkpoint_dir: epath.Path, stage: str, needed_by: str, step: int | None = None) -> int:
    """`restore_latest` (or `step`: a stage's dev-selected one), for a stage that cannot go on without `stage`'s
    checkpoint; returns its step."""
    if step is not None and not (checkpoint_dir / str(step)).is_dir():
        raise CheckpointError(f"{needed_by}: {stage}'s selected checkpoint step {step} is not in {checkpoint_dir}; "
                              f"rerun the `{stage}` pipeline")
    step = restore_latest(model, checkpoint_dir, step)
    if step == 0:
        raise CheckpointError(f"{needed_by}: no {stage} checkpoint in {checkpoint_dir}; run the `{stage}` pipeline first")
    return step


def start_from(model, parent: epath.Path, checkpoint_dir: epath.Path) -> dict:
    """Loads the parent run's latest checkpoint (its best dev step, where it scored its dev split) into `model` (a
    new run on its weights, `sft.init_from`).

    Skipped when this run has checkpoints of its own: it was interrupted, and the
    trainer resumes those. Returns the lineage: parent checkpoint and step.
    """
    lineage = {"parent_checkpoint": str(parent)}
    best = dev_selected_step(parent) if parent.is_dir() else None
    if best is not None:
        lineage["parent_best_step"] = best
    if latest_step(checkpoint_dir) is not None:
        return {**lineage, "parent_step": best or (latest_step(parent) if parent.is_dir() else None)}
    _require_parent(parent)
    try:
        step = restore_latest(model, parent, best)
    except Exception as err:  # Orbax names the tree mismatch only deep inside its message
        raise ModelError(
            f"sft.init_from: cannot load {parent} into this model (LoRA: {sft_utils.is_lora_enabled(model)}); "
            f"the parent must have the same model.source and model.lora settings: {err}"
        ) from err
    log.info("starting from %s step %d (a new run: fresh optimizer, step 0)", parent, step)
    return {**lineage, "parent_step": step}


def check_start(parent: epath.Path, checkpoint_dir: epath.Path) -> None:
    """Refuses an `sft.init_from` that holds no checkpoint, unless this run has checkpoints of its own (it resumes
    those and never reads the parent). Also run before the pipeline starts (`preflight`)."""
    if latest_step(checkpoint_dir) is None:
        _require_parent(parent)


def _require_parent(parent: epath.Path) -> None:
    if not parent.is_dir() or latest_step(parent) is None:
        raise CheckpointError(
            f"sft.init_from: no checkpoint in {parent}; point it at a previous run's sft.checkpoint_dir "
            "(on Kaggle: the attached dataset holding the last session's output)"
        )


def best_step(curve: list[dict]) -> int | None:
    """The step of a dev curve's highest lenient accuracy; between equal ones the higher strict accuracy, then
    format compliance (which a tuned model learns before it answers right); where all three tie, the later step,
    as without a dev curve. None for an empty curve."""
    def key(point: dict) -> tuple:
        return tuple(-1.0 if point.get(m) is None else point[m]
                     for m in ("lenient_accuracy", "answer_accuracy", "format_compliance"))

    best = None
    for point in sorted(curve, key=lambda p: p["step"]):
        if best is None or key(point) >= key(best):
            best = point
    return None if best is None else best["step"]


def no_dev_eval(latest_step: int) -> dict:
    """A stage result's dev part for a run without `dev_eval`: the latest step is the one handed on."""
    return {"dev_curve": [], "best_step": None, "selected_step": latest_step}


def dev_selected_step(ckpt_dir: epath.Path) -> int | None:
    """The best dev step a run with `dev_eval` recorded beside its checkpoints (None: it scored no dev split)."""
    step = best_step(load_history(ckpt_dir, latest_step(ckpt_dir) or 0, DEV_CURVE_FILE))
    return step if step is not None and (ckpt_dir / str(step)).is_dir() else None


# ---------------------------------------------------------------- the history beside them
def logger_options(ckpt_dir: epath.Path, metrics_backends: list | None):
    """Tunix's metrics-logger options sending every metric to `metrics_backends` (None: Tunix's own logs)."""
    if not metrics_backends:
        return None
    return metrics_logger.MetricsLoggerOptions(
        log_dir=str(ckpt_dir / "logs"), backend_kwargs={"custom_backend": metrics_backends}
    )


def metric_history(logger, prefix: str, name: str) -> np.ndarray:
    """Every training value of `prefix`/`name` a Tunix metrics logger holds ("" prefix: SFT's train/loss)."""
    for mode in ("train", metrics_logger.Mode.TRAIN):  # the RL trainers key by the enum
        if logger.metric_exists(prefix, name, mode):
            return np.asarray(logger.get_metric_history(prefix, name, mode), dtype=np.float64).ravel()
    return np.array([])


def load_history(ckpt_dir: epath.Path, upto_step: int, name: str = HISTORY_FILE) -> list[dict]:
    """The per-step history saved beside the checkpoints, up to the restored step."""
    path = ckpt_dir / name
    if not upto_step or not path.is_file():
        return []
    try:
        return [h for h in json.loads(path.read_text()) if h["step"] <= upto_step]
    except (ValueError, TypeError, KeyError) as err:  # edited or damaged by hand: the checkpoints are still good
        target = path.with_name(name + ".corrupt")
        log.warning("%s cannot be read (%s); moved to %s, going on without the values it held", path,
                    _first_line(err), target)
        if jax.process_index() == 0:
            path.rename(target)
        return []


def save_history(ckpt_dir: epath.Path, history: list[dict] | dict, name: str = HISTORY_FILE) -> None:
    """`history` as JSON in `ckpt_dir/name`, whole or not at all (process 0 writes)."""
    if jax.process_index() != 0:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / (name + ".tmp")
    tmp.write_text(json.dumps(history))
    tmp.replace(ckpt_dir / name)


class TrainClock:
    """A stage's training wall time, every run's: a run that resumes, or has nothing left to train, goes on from the
    time saved with the step it restored (`SECONDS_FILE`)."""

    def __init__(self, ckpt_dir: epath.Path, start_step: int):
        self.ckpt_dir, self.started = ckpt_dir, time.perf_counter()
        self.saved = load_history(ckpt_dir, start_step, SECONDS_FILE)
        self.before = self.saved[-1]["train_seconds"] if self.saved else 0.0

    def this_run(self) -> float:
        return time.perf_counter() - self.started

    def total(self) -> float:
        return self.before + self.this_run()

    def save(self, step: int) -> float:
        """The time so far, kept as that of `step` (a step saved now)."""
        total = self.total()
        self.saved = [s for s in self.saved if s["step"] < step] + [{"step": step, "train_seconds": total}]
        save_history(self.ckpt_dir, self.saved, SECONDS_FILE)
        return total


def new_losses(trainer, start_step: int) -> list[dict]:
    """This run's losses so far, with the step Tunix has not written yet (it writes each one a step late)."""
    losses = list(metric_history(trainer.metrics_logger, trainer.metrics_prefix, "loss"))
    if (pending := pending_loss(trainer)) is not None:
        losses.append(pending)
    return [{"step": start_step + i + 1, "loss": float(v)} for i, v in enumerate(losses)]
