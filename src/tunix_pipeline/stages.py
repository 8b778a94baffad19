"""The training stages, in the order they hand a policy on: SFT, then the optional polish stages.

One declaration per stage, read by everything that walks the chain: the pipelines (node and dataset
names), the hooks (training nodes, the session ledger), the Orbax folder check, evaluation after each
polish stage and the training curves, the plan's report, the smoke checks and the export. A polish stage starts from its parent's policy; when it is
off or has nothing to learn from it passes that policy on (`skips.passed_through`), so the chain never breaks.

Adding a polish stage: its module under `train/` (the training, returning a `StageResult`), its pipeline package
under `pipelines/` (its train node named `train_node`, reading `parent_result`, writing `result`, then
`evaluate.policies.evaluate_after`), its config section with `enabled`, `strict` and `checkpoint_dir`, its
planning module `planning/<name>.py` (`add_stage`, its figures in the plan, and `markdown_section`, its section of
the plan's report), its checks before the run (`run.preflight.STAGE_CHECKS`), and one entry in `STAGES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


@dataclass(frozen=True)
class Curve:
    """One line of a stage's panel in the training curves: a key of each step of its history."""

    key: str
    label: str
    log: bool = False  # on a log scale (a loss that falls by orders of magnitude)
    twin: bool = False  # on a second y axis, for a scale of its own (GRPO's KL beside its reward)
    every_step: bool = True  # every step of the history holds it (the smoke checks); False: only some do


@dataclass(frozen=True)
class Stage:
    name: str  # the pipeline, the parameters section, and the prefix of its datasets
    title: str  # in reports and figures
    train_node: str
    parent: str | None  # the stage whose policy this one starts from
    time_budget: bool = False  # its section has `time_budget_hours` (a session's hours bound it)
    curves: tuple[Curve, ...] = ()  # its panel in the training curves: the keys of its history
    # figures the stage measures itself on the policy it started from and on its own, as (key of the first, key of
    # the second) in its result: its evaluation shows them beside the shared metrics, under the second key
    own_figures: tuple[tuple[str, str], ...] = ()

    @property
    def history_keys(self) -> tuple[str, ...]:
        """What each step of its history holds (the smoke checks)."""
        return tuple(curve.key for curve in self.curves if curve.every_step)

    @property
    def result(self) -> str:
        """The dataset of its result: the policy it leaves (`checkpoint_dir`, `latest_step`) and its figures."""
        return f"{self.name}_result"

    @property
    def parent_result(self) -> str | None:
        return f"{self.parent}_result" if self.parent else None

    @property
    def checkpoint_setting(self) -> str:
        return f"{self.name}.checkpoint_dir"

    def eval_outputs(self) -> list[str]:
        """The evaluation after a polish stage: metrics, samples, report, curves."""
        return [f"{self.name}_eval_metrics", f"{self.name}_eval_samples", f"{self.name}_eval_report",
                f"{self.name}_curves"]


class StageResult(TypedDict, total=False):
    """What a training stage leaves (its `result` dataset, JSON): the policy it hands on, how it got there, and its
    own figures beside these keys. A stage that did not train (off, or skipped) hands on its parent's policy."""

    enabled: bool  # False: the stage did not train (`skips.passed_through`)
    skipped: bool  # it had nothing to learn from: `skip_reason`, `skip_fix`
    skip_reason: str
    skip_fix: str
    checkpoint_dir: str  # the policy handed on, at its `latest_step` (or its dev-selected one)
    latest_step: int
    best_step: int | None  # where the stage scored its dev split (`dev_eval`): its best step, also `selected_step`
    selected_step: int | None
    policy_stage: str  # the stage that trained the policy handed on
    start_stage: str  # where it started: its parent's policy (`start_of`)
    start_checkpoint_dir: str
    start_step: int
    start_selected: int
    title: str  # how the reports name its policy where the stage's own title says less (the preference stage: DPO)
    evaluation_note: str | None  # a line of its own for the evaluation report (GRPO: its reward's trend)
    history: list[dict]  # a record per step: its `step`, `loss` and the stage's own curves (`Stage.history_keys`)


SFT = Stage("sft", "SFT", "train_sft", parent=None, time_budget=True,
            curves=(Curve("loss", "train loss", log=True),))
PREFERENCE = Stage("preference", "preference", "run_preference", parent="sft", time_budget=True,
                   curves=(Curve("loss", "loss"), Curve("rewards/margin", "reward margin"),
                           Curve("rewards/accuracy", "pair accuracy", every_step=False)),
                   own_figures=(("heldout_pair_accuracy_before", "heldout_pair_accuracy"),))
GRPO = Stage("grpo", "GRPO", "run_grpo", parent="preference",
             curves=(Curve("reward", "total reward"), Curve("kl", "KL", twin=True, every_step=False)))
STAGES = (SFT, PREFERENCE, GRPO)
POLISH = tuple(stage for stage in STAGES if stage.parent is not None)  # optional: off passes the policy on
TRAINING_NODES = frozenset(stage.train_node for stage in STAGES)
BY_NAME = {stage.name: stage for stage in STAGES}


def policy_stage(result: StageResult) -> str:
    """The stage that trained the policy a result hands on (`checkpoint_dir`): its own, or an earlier one's
    passed through a stage that was off or skipped."""
    return result.get("policy_stage", SFT.name)


def selected_step(result: StageResult) -> int | None:
    """The step of a stage's checkpoint folder that the later stages restore: the best dev step where the stage
    scored its dev split (`dev_eval`), else None: the latest."""
    return result.get("selected_step") if result.get("best_step") is not None else None


def policy_step(result: StageResult) -> int:
    """The step of the policy a result hands on: its dev-selected step, else its latest."""
    step = selected_step(result)
    return result.get("latest_step") if step is None else step


def start_of(parent_result: StageResult) -> StageResult:
    """Where a stage starts: its parent's policy, the stage that trained it, and its step (also as `start_selected`
    when the parent chose it by its dev score)."""
    start = {"start_stage": policy_stage(parent_result), "start_checkpoint_dir": parent_result["checkpoint_dir"],
             "start_step": policy_step(parent_result)}
    if selected_step(parent_result) is not None:
        start["start_selected"] = selected_step(parent_result)
    return start
