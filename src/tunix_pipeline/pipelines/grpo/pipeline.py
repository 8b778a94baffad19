from kedro.pipeline import Node, Pipeline

from tunix_pipeline.evaluate.policies import evaluate_after
from tunix_pipeline.stages import GRPO, SFT

from .nodes import run_grpo


def create_pipeline(**kwargs) -> Pipeline:
    """GRPO from its parent's policy, then the evaluation after it."""
    return Pipeline(
        [
            Node(
                run_grpo,
                inputs=[
                    "train_formatted", "eval_formatted", "base_model", GRPO.parent_result, "params:model", "params:grpo",
                    "params:runtime", "params:tracking",
                ],
                outputs=GRPO.result,
                name=GRPO.train_node,
            ),
            Node(
                evaluate_after(GRPO),
                inputs=[
                    "eval_tokens", "eval_formatted", "eval_few_shot", "eval_samples", "base_model", SFT.result,
                    GRPO.result, "params:model", "params:evaluate", "params:runtime",
                ],
                outputs=GRPO.eval_outputs(),
                name=f"evaluate_after_{GRPO.name}",
            ),
        ]
    )
