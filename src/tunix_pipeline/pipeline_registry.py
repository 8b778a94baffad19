"""The project's pipelines: one per stage, the real DAG, and `smoke`."""

from kedro.pipeline import Pipeline

from tunix_pipeline.pipelines import (
    base_model, evaluate, export, format, grpo, ingest, plan, preference, sft, smoke, tokenize,
)


def register_pipelines() -> dict[str, Pipeline]:
    stages = {
        "ingest": ingest.create_pipeline(),
        "base_model": base_model.create_pipeline(),
        "format": format.create_pipeline(),
        "tokenize": tokenize.create_pipeline(),
        "sft": sft.create_pipeline(),
        "evaluate": evaluate.create_pipeline(),
        # DPO / ORPO / SimPO and the evaluation after it; with `preference.enabled: false` SFT's checkpoint passes on
        "preference": preference.create_pipeline(),
        # GRPO from the policy before it (the preference stage's, or SFT's) and the evaluation after it; off: the
        # policy passes through
        "grpo": grpo.create_pipeline(),
        "export": export.create_pipeline(),
    }
    dag = sum(stages.values(), Pipeline([]))
    # `--pipelines=grpo` polishes the SFT checkpoint: the preference stage first (a pass-through when it is off),
    # so GRPO always has the policy to start from; `--pipelines=preference` runs that stage alone
    pipelines = {**stages, "grpo": stages["preference"] + stages["grpo"]}
    return {**pipelines, "plan": plan.create_pipeline(), "smoke": dag + smoke.create_pipeline(), "__default__": dag}
