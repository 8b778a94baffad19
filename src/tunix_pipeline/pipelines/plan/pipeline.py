from kedro.pipeline import Node, Pipeline

from .nodes import plan_training


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                plan_training,
                # tokenize_report: None until the tokenize stage has written it (an `OptionalJSONDataset`)
                inputs=["tokenize_report", "params:model", "params:sft", "params:runtime", "params:tokenize", "params:plan",
                        "params:preference", "params:sessions", "params:grpo", "params:export", "params:tracking"],
                outputs=["plan_summary", "plan_report"],
                name="plan_training",
            )
        ]
    )
