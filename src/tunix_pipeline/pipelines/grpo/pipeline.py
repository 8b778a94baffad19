from kedro.pipeline import Node, Pipeline

from tunix_pipeline.pipelines import RUN_GRPO
from tunix_pipeline.pipelines.evaluate.nodes import evaluate_after_grpo

from .nodes import run_grpo


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                run_grpo,
                inputs=[
                    "train_formatted", "base_model", "preference_result", "params:model", "params:grpo", "params:runtime",
                    "params:tracking",
                ],
                outputs="grpo_result",
                name=RUN_GRPO,
            ),
            Node(
                evaluate_after_grpo,
                inputs=[
                    "eval_tokens",
                    "eval_formatted",
                    "base_model",
                    "sft_result",
                    "grpo_result",
                    "params:model",
                    "params:evaluate",
                    "params:runtime",
                ],
                outputs=["grpo_eval_metrics", "grpo_eval_samples", "grpo_eval_report", "grpo_curves"],
                name="evaluate_after_grpo",
            ),
        ]
    )
