from kedro.pipeline import Node, Pipeline

from tunix_pipeline.stages import SFT

from .nodes import check_sft_fits, train_sft


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            # the plan first (plan.enabled): a run that cannot fit stops here, before any weights
            # are read; train_sft takes the base model through it, so it always runs after it
            Node(
                check_sft_fits,
                inputs=[
                    "base_model", "train_tokens", "tokenize_report", "params:model", "params:sft", "params:runtime",
                    "params:tokenize", "params:plan", "params:preference", "params:grpo", "params:export",
                    "params:tracking", "eval_formatted", "eval_few_shot", "params:evaluate",
                ],
                outputs=["planned_base_model", "sft_plan"],
                name="check_sft_fits",
            ),
            Node(
                train_sft,
                inputs=[
                    "train_tokens", "eval_tokens", "eval_formatted", "planned_base_model", "params:model", "params:sft",
                    "params:runtime", "params:tracking", "params:plan",
                ],
                outputs=SFT.result,
                name=SFT.train_node,
            ),
        ]
    )
