from kedro.pipeline import Node, Pipeline

from .nodes import check_smoke


def create_pipeline(**kwargs) -> Pipeline:
    """The smoke checks; the registry adds them to the whole DAG."""
    return Pipeline(
        [
            Node(
                check_smoke,
                inputs=[
                    "sft_result", "eval_metrics", "preference_result", "preference_eval_metrics", "grpo_result",
                    "grpo_eval_metrics", "exported_model",
                ],
                outputs="smoke_report",
                name="check_smoke",
            )
        ]
    )
