from kedro.pipeline import Node, Pipeline

from tunix_pipeline.stages import POLISH, STAGES

from .nodes import check_smoke


def create_pipeline(**kwargs) -> Pipeline:
    """The smoke checks; the registry adds them to the whole DAG."""
    stage_outputs = [stage.result for stage in STAGES] + [stage.eval_outputs()[0] for stage in POLISH]
    return Pipeline(
        [
            Node(
                check_smoke,
                inputs={"exported_model": "exported_model", "eval_metrics": "eval_metrics",
                        **{name: name for name in stage_outputs}},
                outputs="smoke_report",
                name="check_smoke",
            )
        ]
    )
