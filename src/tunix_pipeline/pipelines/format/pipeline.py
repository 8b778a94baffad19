from kedro.pipeline import Node, Pipeline

from .nodes import format_eval_few_shot, format_split


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                format_split,
                inputs=[f"{split}_records", "base_model", "params:format"],
                outputs=f"{split}_formatted",
                name=f"format_{split}",
            )
            for split in ("train", "eval")
        ]
        + [
            Node(
                format_eval_few_shot,
                inputs=["eval_records", "train_records", "base_model", "params:format", "params:evaluate"],
                outputs="eval_few_shot",
                name="format_eval_few_shot",
            )
        ]
    )
