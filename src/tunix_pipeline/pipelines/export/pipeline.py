from kedro.pipeline import Node, Pipeline

from tunix_pipeline.stages import STAGES

from .nodes import export_model


def create_pipeline(**kwargs) -> Pipeline:
    """The last trained policy of the stages' chain, exported."""
    return Pipeline(
        [
            Node(
                export_model,
                # by keyword: every stage's result, whatever stages there are (the parameters first, in the
                # function's order, as Kedro's validation maps them by position)
                inputs={
                    "base_model": "base_model", "model": "params:model", "params": "params:export",
                    "runtime": "params:runtime", "format_params": "params:format",
                    **{stage.result: stage.result for stage in STAGES},
                },
                outputs="exported_model",
                name="export_model",
            )
        ]
    )
