from kedro.pipeline import Node, Pipeline

from tunix_pipeline.evaluate.policies import evaluate_after
from tunix_pipeline.stages import PREFERENCE, SFT

from .nodes import build_pairs, run_preference


def create_pipeline(**kwargs) -> Pipeline:
    """Pairs -> DPO / ORPO / SimPO from its parent's policy (SFT's) -> its evaluation."""
    return Pipeline(
        [
            Node(
                build_pairs,
                inputs=[
                    "train_formatted", "eval_formatted", "base_model", PREFERENCE.parent_result, "params:model",
                    "params:preference", "params:grpo.rewards", "params:format", "params:runtime",
                ],
                outputs=["preference_train_pairs", "preference_eval_pairs", "preference_pairs_report"],
                name="build_preference_pairs",
            ),
            Node(
                run_preference,
                inputs=[
                    "preference_train_pairs", "preference_eval_pairs", "preference_pairs_report", "base_model",
                    PREFERENCE.parent_result, "params:model", "params:preference", "params:runtime",
                    "params:tracking", "params:plan",
                ],
                outputs=PREFERENCE.result,
                name=PREFERENCE.train_node,
            ),
            Node(
                evaluate_after(PREFERENCE),
                inputs=[
                    "eval_tokens", "eval_formatted", "eval_few_shot", "eval_samples", "base_model", SFT.result,
                    PREFERENCE.result, "params:model", "params:evaluate", "params:runtime",
                ],
                outputs=PREFERENCE.eval_outputs(),
                name=f"evaluate_after_{PREFERENCE.name}",
            ),
        ]
    )
