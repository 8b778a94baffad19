"""Scoring the dev split while a stage trains (SFT, GRPO), and keeping the best step rather than the last.

With `sft.dev_eval` / `grpo.dev_eval` on, every `every` steps and at the last one the policy generates greedily
for the first `prompts` dev rows of the eval split (rows whose `split` is "dev", or that have no `split`: never the
evaluation-only test sources) and `evaluation.score` reads the answers as `evaluate` does. Each point is logged as
`dev/<metric>` at its step (a later stage's as `grpo/dev/<metric>`) and kept in `dev_curve.json` beside the
checkpoints, so a resumed run continues the curve. The evaluation runs right after a checkpoint is saved (the dev
steps are save steps), on exactly the weights saved; the step with the highest lenient accuracy (`checkpoints.
best_step`: ties go to strict accuracy, then format, then the later step) is preserved through `keep_checkpoints`
pruning and is the stage's `selected_step`, the one the later stages restore. Lenient accuracy (the last number)
chooses first, not strict: early in training few answers are tagged yet.
"""

from __future__ import annotations

import logging

import pandas as pd
from etils import epath

from tunix_pipeline.config import DevEvalParams, EvaluateParams
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.evaluate import evaluation
from tunix_pipeline.generate.generation import Generator, select_prompts
from tunix_pipeline.stages import SFT
from tunix_pipeline.tracking.step_metrics import MlflowBackend
from tunix_pipeline.train import checkpoints
from tunix_pipeline.train.checkpoints import DEV_CURVE_FILE as CURVE_FILE
from tunix_pipeline.train.checkpoints import best_step

log = logging.getLogger(__name__)
METRICS = ("lenient_accuracy", "answer_accuracy", "format_compliance")
__all__ = ["CURVE_FILE", "METRICS", "DevEval", "KeepStep", "best_step", "dev_rows", "log_curve", "metric_prefix"]


def dev_rows(eval_formatted: pd.DataFrame) -> pd.DataFrame:
    """The eval rows carved from the training sources: `split` "dev", or no `split` at all."""
    if "split" not in eval_formatted:
        return eval_formatted.reset_index(drop=True)
    split = eval_formatted["split"]
    return eval_formatted[split.isna() | (split == "dev")].reset_index(drop=True)


def generation_params(settings: DevEvalParams) -> EvaluateParams:
    """The dev evaluation's generation: greedy, as `evaluate` scores, on the first `settings.prompts` dev rows."""
    return EvaluateParams(num_prompts=settings.prompts, max_new_tokens=settings.max_new_tokens,
                          batch_size=settings.batch_size, compare_base_model=False)


def prompt_length(settings: DevEvalParams, tokenizer, eval_formatted: pd.DataFrame) -> int:
    """The prompt length the dev evaluation's sampler is sized for (0 without dev rows)."""
    return select_prompts(dev_rows(eval_formatted), tokenizer, generation_params(settings))[2]


class KeepStep:
    """An Orbax preservation policy keeping one checkpoint, the best so far; it moves as the curve grows."""

    def __init__(self, step: int | None = None):
        self.step = step

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        return [info.step == self.step for info in checkpoints]

    def __deepcopy__(self, memo):
        return self  # one live handle: Tunix's RL cluster deep-copies its training config, options included


class DevEval:
    """The dev split's generation and score for one training run, whose model's weights change in place.

    Made before the trainer (its checkpoint options save at the dev steps and preserve `keep`), then `start`ed on
    the trainer, which it measures after each save at a dev step.
    """

    def __init__(self, settings: DevEvalParams, tokenizer, eval_formatted: pd.DataFrame | None, stage: str,
                 decode_weights: str = "sharded"):
        self.settings, self.stage, self.tokenizer, self.decode_weights = settings, stage, tokenizer, decode_weights
        self.params = generation_params(settings)
        rows = dev_rows(eval_formatted) if eval_formatted is not None else pd.DataFrame()
        self.rows, _, self.prompt_length = select_prompts(rows, tokenizer, self.params)
        if not len(self.rows):
            raise UserError(f"{stage}.dev_eval: the eval split has no dev rows to score (rows carved from the "
                            f"training sources by ingest.eval_fraction); raise ingest.eval_fraction or set "
                            f"{stage}.dev_eval: null")
        self.keep = KeepStep()
        self.curve: list[dict] = []
        self.model = self.curve_dir = self._generator = None
        self.max_steps, self.examples_per_step = None, 0.0

    def start(self, trainer, mesh, curve_dir: epath.Path, examples_per_step: float, stopping=lambda: False) -> DevEval:
        """Continues the curve saved in `curve_dir` up to the trainer's restored step (its best step stays
        preserved), then measures after each checkpoint `trainer` saves at a dev step (wraps its manager's `save`)
        unless `stopping()`: a preempted run saves and leaves at once, and its point is measured when it resumes."""
        self.model = trainer.model  # the weights it trains (GRPO's actor may be a copy placed on its mesh)
        self.curve_dir, self.max_steps, self.examples_per_step = curve_dir, trainer.config.max_steps, examples_per_step
        self.curve = checkpoints.load_history(curve_dir, trainer.train_steps, CURVE_FILE)
        self.keep.step = best_step(self.curve)
        manager = trainer.checkpoint_manager
        save = manager.save

        def save_and_measure(step, *args, **kwargs):
            saved = save(step, *args, **kwargs)
            if saved and not stopping():
                self.catch_up(step, mesh, trainer.metrics_logger)
            return saved

        manager.save = save_and_measure
        self.catch_up(trainer.train_steps, mesh, trainer.metrics_logger)  # saved by a session stopped before its point
        return self

    def due(self, step: int) -> bool:
        return step > 0 and (step % self.settings.every == 0 or step == self.max_steps)

    def catch_up(self, step: int, mesh, metrics_logger=None) -> None:
        """Measures the model, now at `step`, if that is a dev step without its point yet."""
        if self.due(step) and step not in {p["step"] for p in self.curve}:
            self.measure(step, mesh, metrics_logger)

    def measure(self, step: int, mesh, metrics_logger=None) -> dict:
        """Scores the model as it is now (step `step`), adds the point to the curve and saves the curve."""
        if self._generator is None:
            self._generator = Generator(self.model, self.tokenizer, self.params, self.prompt_length,
                                        self.decode_weights)
        with mesh:
            texts, lengths = self._generator(self.rows["prompt"].tolist())
        metrics, _ = evaluation.score(self.stage, self.rows, texts, self.params, lengths)
        point = {"step": step, "examples": round(step * self.examples_per_step), "prompts": len(self.rows),
                 **{name: metrics[name] for name in METRICS}}
        self.curve = [p for p in self.curve if p["step"] < step] + [point]
        self.keep.step = best_step(self.curve)
        checkpoints.save_history(self.curve_dir, self.curve, CURVE_FILE)
        log.info("%s: dev at step %d: lenient %s, strict %s, format %s (best step %s)", self.stage, step,
                 *(_fmt(point[name]) for name in METRICS), self.keep.step)
        if metrics_logger is not None:  # `dev/<metric>` in MLflow (and W&B), through the trainer's backends
            for name in METRICS:
                if point[name] is not None:
                    metrics_logger.log(metric_prefix(self.stage), name, point[name], "dev", step)
        return point

    def summary(self, latest_step: int) -> dict:
        """The stage result's part: the curve, the best step and the step the later stages restore."""
        best = best_step(self.curve)
        point = next((p for p in self.curve if p["step"] == best), {})
        return {"dev_curve": self.curve, "best_step": best, "selected_step": latest_step if best is None else best,
                "best_dev_lenient_accuracy": point.get("lenient_accuracy")}


def metric_prefix(stage: str) -> str:
    """SFT's dev curve is `dev/<metric>`, a later stage's `<stage>/dev/<metric>`: one MLflow run holds them all."""
    return "" if stage == SFT.name else stage


def log_curve(curve: list[dict], stage: str) -> None:
    """`stage`'s dev curve in the active MLflow run, each point it lacks: one measured after the trainer's metrics
    backends closed, or by an earlier session of a resumed run."""
    backend = MlflowBackend()
    for metric in METRICS:
        backend.fill_gaps(f"{metric_prefix(stage)}/dev/{metric}".lstrip("/"), curve, key=metric)


def _fmt(value) -> str:
    return "—" if value is None else f"{value:.3f}"

