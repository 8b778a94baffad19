from kedro.pipeline import Node, Pipeline

from .nodes import train_sft


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                train_sft,
                inputs=["train_tokens", "eval_tokens", "base_model", "params:model", "params:sft", "params:runtime"],
                outputs="sft_result",
                name="train_sft",
            )
        ]
    )
