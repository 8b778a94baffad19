"""The training stages, in the order they hand a policy on: SFT, then the optional polish stages.

One declaration per stage, read by everything that walks the chain: the pipelines (node and dataset
names), the hooks (training nodes, the session ledger), the Orbax folder check, evaluation after each
polish stage, the smoke checks and the export. A polish stage starts from its parent's policy; when it is
off or has nothing to learn from it passes that policy on (`skips.passed_through`), so the chain never breaks.

Adding a polish stage: its module (the training), its pipeline package under `pipelines/` (its train node
named `train_node`, reading `parent_result`, writing `result`, then `evaluate.policies.evaluate_after`), its
config section with `enabled`, `strict` and `checkpoint_dir`, and one entry in `STAGES`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str  # the pipeline, the parameters section, and the prefix of its datasets
    title: str  # in reports and figures
    train_node: str
    parent: str | None  # the stage whose policy this one starts from
    history_keys: tuple[str, ...] = ()  # what each step of its history must hold (the smoke checks)
    time_budget: bool = False  # its section has `time_budget_hours` (a session's hours bound it)

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


SFT = Stage("sft", "SFT", "train_sft", parent=None, history_keys=("loss",), time_budget=True)
PREFERENCE = Stage("preference", "preference", "run_preference", parent="sft",
                   history_keys=("loss", "rewards/margin"), time_budget=True)
GRPO = Stage("grpo", "GRPO", "run_grpo", parent="preference", history_keys=("reward",))
STAGES = (SFT, PREFERENCE, GRPO)
POLISH = tuple(stage for stage in STAGES if stage.parent is not None)  # optional: off passes the policy on
TRAINING_NODES = frozenset(stage.train_node for stage in STAGES)


def policy_stage(result: dict) -> str:
    """The stage that trained the policy a result hands on (`checkpoint_dir`): its own, or an earlier one's
    passed through a stage that was off or skipped."""
    return result.get("policy_stage", SFT.name)


def selected_step(result: dict) -> int | None:
    """The step of a stage's checkpoint folder that the later stages restore: the best dev step where the stage
    scored its dev split (`dev_eval`), else None: the latest."""
    return result.get("selected_step") if result.get("best_step") is not None else None


def policy_step(result: dict) -> int:
    """The step of the policy a result hands on: its dev-selected step, else its latest."""
    step = selected_step(result)
    return result.get("latest_step") if step is None else step


def start_of(parent_result: dict) -> dict:
    """Where a stage starts: its parent's policy, the stage that trained it, and its step (also as `start_selected`
    when the parent chose it by its dev score)."""
    start = {"start_stage": policy_stage(parent_result), "start_checkpoint_dir": parent_result["checkpoint_dir"],
             "start_step": policy_step(parent_result)}
    if selected_step(parent_result) is not None:
        start["start_selected"] = selected_step(parent_result)
    return start
