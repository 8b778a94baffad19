from kedro.pipeline import Node, Pipeline

from .nodes import format_split


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
    )
