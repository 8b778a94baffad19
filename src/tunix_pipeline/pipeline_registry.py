"""The project's pipelines: one per stage, the real DAG, and `smoke`."""

from kedro.pipeline import Pipeline

from tunix_pipeline.pipelines import base_model, evaluate, export, format, grpo, ingest, plan, sft, smoke, tokenize


def register_pipelines() -> dict[str, Pipeline]:
    stages = {
        "ingest": ingest.create_pipeline(),
        "base_model": base_model.create_pipeline(),
        "format": format.create_pipeline(),
        "tokenize": tokenize.create_pipeline(),
        "sft": sft.create_pipeline(),
        "evaluate": evaluate.create_pipeline(),
        # GRPO and the evaluation after it; with `grpo.enabled: false` the SFT checkpoint passes through
        "grpo": grpo.create_pipeline(),
        "export": export.create_pipeline(),
    }
    dag = sum(stages.values(), Pipeline([]))
    return {**stages, "plan": plan.create_pipeline(), "smoke": dag + smoke.create_pipeline(), "__default__": dag}
