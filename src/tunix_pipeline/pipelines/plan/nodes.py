from tunix_pipeline.config import (
    ExportParams, GrpoParams, ModelParams, PlanParams, PreferenceParams, RuntimeParams, SftParams, TokenizeParams,
    TrackingParams,
)
from tunix_pipeline.planning import PlannedStage, build_plan, markdown, stage_planning, with_xla_check
from tunix_pipeline.planning.disk import add_disk, disk_sessions, plan_disk
from tunix_pipeline.stages import GRPO, POLISH, PREFERENCE, SFT


def plan_training(
    tokenize_report: dict | None, model: ModelParams, sft: SftParams, runtime: RuntimeParams, tokenize: TokenizeParams,
    plan: PlanParams, preference: PreferenceParams, sessions: dict, grpo: GrpoParams,
    export: ExportParams = None, tracking: TrackingParams = None,  # plain hints: Kedro validates one type a section
) -> tuple[dict, str]:
    """The plan for every hardware profile (SFT, and each polish stage when this run or a later session of
    `sessions.plan` turns it on), checked against XLA (on a TPU profile: compiled for its topology, and resting on
    that); printed, and returned as JSON and Markdown. `tokenize_report` (None before the tokenize stage has run):
    the padding of the rows, for the useful tokens, examples and epochs."""
    sections = {SFT.name: sft, PREFERENCE.name: preference, GRPO.name: grpo}
    # the XLA check may rebuild the plan on the compiled figures: the polish stages are added after it
    result = with_xla_check(build_plan(model, sft, runtime, tokenize, plan, tokenize_report=tokenize_report), model, plan)
    for stage in POLISH:
        planned = PlannedStage.of(stage.name, sections[stage.name], sessions)
        result = stage_planning(stage).add_stage(result, planned, model, plan, runtime)
    if export is not None:  # the disk counts each session's own stages
        result = add_disk(result, plan_disk(
            result.job.arch, result.selected.setup, result.selected.hw,
            disk_sessions(model, sections, sessions, result.job.max_steps), export, tracking, runtime.output_root,
        ))
    text = markdown(result)
    print(text)  # noqa: T201 - the table is this pipeline's output
    return result.summary(), text
