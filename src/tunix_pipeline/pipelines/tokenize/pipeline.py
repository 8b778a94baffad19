from kedro.pipeline import Node, Pipeline

from .nodes import tokenize


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                tokenize,
                inputs=["train_formatted", "eval_formatted", "base_model", "params:tokenize", "params:sft"],
                outputs=["train_tokens", "eval_tokens", "tokenize_report"],
                name="tokenize",
            )
        ]
    )
