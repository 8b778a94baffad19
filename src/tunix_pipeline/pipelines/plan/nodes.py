from tunix_pipeline.config import (
    ExportParams, GrpoParams, ModelParams, PlanParams, PreferenceParams, RuntimeParams, SftParams, TokenizeParams,
    TrackingParams,
)
from tunix_pipeline.planning import build_plan, grpo_xla, markdown, with_xla_check
from tunix_pipeline.planning.disk import add_disk, disk_sessions, plan_disk
from tunix_pipeline.planning.grpo import add_grpo, loaded_in
from tunix_pipeline.planning.preference import add_preference
from tunix_pipeline.planning.preference import check_against_xla as check_preference_against_xla
from tunix_pipeline.stages import PREFERENCE


def plan_training(
    tokenize_report: dict | None, model: ModelParams, sft: SftParams, runtime: RuntimeParams, tokenize: TokenizeParams,
    plan: PlanParams, preference: PreferenceParams, sessions: dict, grpo: GrpoParams,
    export: ExportParams = None, tracking: TrackingParams = None,  # plain hints: Kedro validates one type a section
) -> tuple[dict, str]:
    """The plan for every hardware profile (SFT, and the preference stage and GRPO when this run or a later
    session of `sessions.plan` turns them on), checked against XLA (on a TPU profile: compiled for its
    topology, and resting on that); printed, and returned as JSON and Markdown. `tokenize_report` (None before
    the tokenize stage has run): the padding of the rows, for the useful tokens, examples and epochs."""
    as_configured = grpo  # the disk counts each session's own stages (below, GRPO is the session that turns it on)
    # the XLA check may rebuild the plan on the compiled figures: the preference stage is added after it
    result = with_xla_check(build_plan(model, sft, runtime, tokenize, plan, tokenize_report=tokenize_report), model, plan)
    result = add_preference(result, _planned_preference(preference, sessions), plan)
    if plan.xla_check.enabled and PREFERENCE.name in result.polish:
        result.polish[PREFERENCE.name]["xla_check"] = check_preference_against_xla(
            result, model, plan.xla_check.max_layers, plan.xla_check.timeout_seconds
        )
    grpo, grpo_hours, grpo_session = _planned_stage("grpo", grpo, sessions)
    grpo_model = model.changed(grpo_session.get("model"))  # GRPO loads the model as its session does
    policy = loaded_in(result, grpo_model.dtype)
    compiled = None
    if plan.xla_check.enabled and plan.xla_check.grpo and grpo.enabled:  # XLA:TPU only: None unless libtpu or a TPU is at hand
        compiled = grpo_xla.check(policy, grpo_model, grpo, plan.xla_check.max_layers, plan, runtime.decode_weights)
    policy = add_grpo(policy, grpo, plan, grpo_hours, compiled)
    result.polish, result.warnings, result.status = policy.polish, policy.warnings, policy.status
    if export is not None:
        result = add_disk(result, plan_disk(
            result.job.arch, result.selected.setup, result.selected.hw,
            disk_sessions(model, sft, preference, as_configured, sessions, result.job.max_steps),
            export, tracking, runtime.output_root,
        ))
    text = markdown(result)
    print(text)  # noqa: T201 - the table is this pipeline's output
    return result.summary(), text


def _planned_preference(preference: PreferenceParams, sessions: dict) -> PreferenceParams:
    """The preference stage as this run has it, or as the first session of the plan that turns it on."""
    planned, hours, _ = _planned_stage("preference", preference, sessions)
    return planned.model_copy(update={"time_budget_hours": hours}) if hours else planned


def _planned_stage(section: str, params, sessions: dict):
    """(the stage's parameters as this run has them, or as the first session of `sessions.plan` that turns it on;
    that session's hours, or None; that session's parameter changes, or {})."""
    if params.enabled:
        return params, None, {}
    for session in (sessions or {}).get("plan") or []:
        changes = session.get("params") or {}
        if (changes.get(section) or {}).get("enabled"):
            return params.changed(changes[section]), session["hours"], changes
    return params, None, {}
