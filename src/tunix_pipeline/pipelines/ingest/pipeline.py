from kedro.pipeline import Node, Pipeline

from .nodes import ingest_sources


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                ingest_sources,
                inputs="params:ingest",
                outputs=["train_records", "eval_records", "data_quality_report"],
                name="ingest_sources",
            )
        ]
    )
