from kedro.pipeline import Node, Pipeline

from tunix_pipeline.pipelines import RUN_PREFERENCE
from tunix_pipeline.pipelines.evaluate.nodes import evaluate_after_preference

from .nodes import build_pairs, run_preference


def create_pipeline(**kwargs) -> Pipeline:
    """SFT -> pairs -> DPO / ORPO / SimPO -> its evaluation; GRPO (when on) starts from `preference_result`."""
    return Pipeline(
        [
            Node(
                build_pairs,
                inputs=[
                    "train_formatted", "eval_formatted", "base_model", "sft_result", "params:model",
                    "params:preference", "params:grpo", "params:format", "params:runtime",
                ],
                outputs=["preference_train_pairs", "preference_eval_pairs", "preference_pairs_report"],
                name="build_preference_pairs",
            ),
            Node(
                run_preference,
                inputs=[
                    "preference_train_pairs", "preference_eval_pairs", "preference_pairs_report", "base_model",
                    "sft_result", "params:model",
                    "params:preference", "params:runtime", "params:tracking", "params:plan",
                ],
                outputs="preference_result",
                name=RUN_PREFERENCE,
            ),
            Node(
                evaluate_after_preference,
                inputs=[
                    "eval_tokens", "eval_formatted", "base_model", "sft_result", "preference_result",
                    "params:model", "params:evaluate", "params:runtime",
                ],
                outputs=[
                    "preference_eval_metrics", "preference_eval_samples", "preference_eval_report", "preference_curves",
                ],
                name="evaluate_after_preference",
            ),
        ]
    )
