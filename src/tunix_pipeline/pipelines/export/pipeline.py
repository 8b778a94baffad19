from kedro.pipeline import Node, Pipeline

from .nodes import export_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                export_model,
                inputs=[
                    "base_model", "sft_result", "preference_result", "grpo_result",
                    "params:model", "params:export", "params:runtime", "params:format",
                ],
                outputs="exported_model",
                name="export_model",
            )
        ]
    )
