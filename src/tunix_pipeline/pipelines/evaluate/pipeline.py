from kedro.pipeline import Node, Pipeline

from tunix_pipeline.evaluate.policies import evaluate_models


def create_pipeline(**kwargs) -> Pipeline:
    """Base vs SFT model; the evaluation after GRPO belongs to the `grpo` pipeline."""
    return Pipeline(
        [
            Node(
                evaluate_models,
                inputs=[
                    "eval_tokens",
                    "eval_formatted",
                    "base_model",
                    "sft_result",
                    "params:model",
                    "params:evaluate",
                    "params:runtime",
                ],
                outputs=["eval_metrics", "eval_samples", "eval_report", "loss_curve"],
                name="evaluate_models",
            )
        ]
    )
