"""An optional polish stage (preference, GRPO) with nothing to learn from is skipped, not fatal.

The stage logs one warning (why, and which setting to change), records the skip in the MLflow run
(`<stage>.skipped`, `<stage>.skip_reason`) and in its result, and passes its parent's policy on, so
evaluation, the next stage and the export go on from the last trained checkpoint. `<stage>.strict: true`
fails the run instead.
"""

from __future__ import annotations

import logging

import mlflow

from tunix_pipeline.core.errors import UserError
from tunix_pipeline.core.processes import is_main_process
from tunix_pipeline.stages import StageResult, policy_stage, selected_step, start_of

log = logging.getLogger(__name__)
MLFLOW_TAG_LIMIT = 5000  # characters of a tag value MLflow keeps


class NothingToLearn(UserError, ValueError):
    """A polish stage has no pair or prompt to train on: `reason` says why, `fix` which setting to change."""

    def __init__(self, stage: str, reason: str, fix: str):
        self.stage, self.reason, self.fix = stage, reason, fix
        super().__init__(f"{stage}: {reason}: {fix}")


def passed_through(parent_result: StageResult) -> StageResult:
    """The result of a stage that did not train (off or skipped): its parent's policy, which the later stages use,
    and where it would have started (`start_*`, as a trained stage records them)."""
    passed = {"enabled": False, "checkpoint_dir": parent_result["checkpoint_dir"],
              "latest_step": parent_result["latest_step"], "policy_stage": policy_stage(parent_result),
              **start_of(parent_result)}
    if selected_step(parent_result) is not None:  # the parent's dev-selected step passes on with its policy
        passed.update(best_step=parent_result["best_step"], selected_step=parent_result["selected_step"])
    return passed


def skip_stage(err: NothingToLearn, strict: bool, parent_policy: StageResult) -> StageResult:
    """The stage's result when it is skipped: `parent_policy` (`passed_through`) with the reason; `err` itself
    when `strict`."""
    if strict:
        raise err
    log.warning("%s skipped: %s. To train it: %s (`%s.strict: true` fails the run instead)",
                err.stage, err.reason, err.fix, err.stage)
    _tag_run(err)
    return {**parent_policy, "skipped": True, "skip_reason": err.reason, "skip_fix": err.fix}


def _tag_run(err: NothingToLearn) -> None:
    if mlflow.active_run() is not None and is_main_process():
        mlflow.set_tags({f"{err.stage}.skipped": "true",
                         f"{err.stage}.skip_reason": f"{err.reason}: {err.fix}"[:MLFLOW_TAG_LIMIT]})
