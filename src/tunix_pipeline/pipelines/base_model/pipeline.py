from kedro.pipeline import Node, Pipeline

from .nodes import prepare_base_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                prepare_base_model,
                inputs=["train_records", "params:model"],
                outputs="base_model",
                name="prepare_base_model",
            )
        ]
    )
