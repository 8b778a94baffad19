from kedro.pipeline import Node, Pipeline

from tunix_pipeline.evaluate.policies import evaluate_models
from tunix_pipeline.stages import SFT


def create_pipeline(**kwargs) -> Pipeline:
    """The base model against SFT's; each polish stage's pipeline evaluates its own policy (`evaluate_after`)."""
    return Pipeline(
        [
            Node(
                evaluate_models,
                inputs=[
                    "eval_tokens",
                    "eval_formatted",
                    "eval_few_shot",
                    "base_model",
                    SFT.result,
                    "params:model",
                    "params:evaluate",
                    "params:runtime",
                ],
                outputs=["eval_metrics", "eval_samples", "eval_report", "loss_curve"],
                name="evaluate_models",
            )
        ]
    )
