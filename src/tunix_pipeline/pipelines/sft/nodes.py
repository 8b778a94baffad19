import logging

import mlflow
import pandas as pd

from tunix_pipeline.config import (
    EvaluateParams,
    ExportParams,
    GrpoParams,
    ModelParams,
    PlanParams,
    PreferenceParams,
    RuntimeParams,
    SftParams,
    TokenizeParams,
    TrackingParams,
)
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.evaluate import dev_eval, evaluation
from tunix_pipeline.evaluate.dev_eval import DevEval, log_curve
from tunix_pipeline.models import load_run_model, load_tokenizer, parameter_counts
from tunix_pipeline.planning import (
    DoesNotFit,
    PlannedStage,
    build_plan,
    peak_flops_per_device,
    refusal,
    stage_planning,
    with_xla_check,
)
from tunix_pipeline.planning.disk import add_disk, disk_sessions, plan_disk
from tunix_pipeline.planning.grpo import refusal as grpo_refusal
from tunix_pipeline.planning.scoring import add_scoring
from tunix_pipeline.planning.scoring import refusal as scoring_refusal
from tunix_pipeline.stages import GRPO, PREFERENCE, SFT, StageResult
from tunix_pipeline.tracking.step_metrics import MlflowBackend, metrics_backends
from tunix_pipeline.train.sft import train

log = logging.getLogger(__name__)


def train_sft(
    train_tokens: pd.DataFrame,
    eval_tokens: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
    tracking: TrackingParams,
    plan: PlanParams,
) -> StageResult:
    mesh = make_mesh(runtime)
    network, _ = load_run_model(base_model["path"], model, mesh, remat=sft.remat, compute_dtype=sft.compute_dtype)
    trains = sft.max_steps != 0  # by steps or by epochs (None); 0: the parent's checkpoint passes on (`train`)
    # the dev split's score and the best step (`sft.dev_eval`)
    dev = DevEval(sft.dev_eval, load_tokenizer(base_model["path"]), eval_formatted, "sft",
                  runtime.decode_weights) if sft.dev_eval and trains else None
    result = train(
        network, train_tokens, eval_tokens, sft, mesh,
        metrics_backends(tracking, runtime.output_root, "sft"), peak_flops_per_device(plan, runtime), dev,
    )
    if trains and mlflow.active_run() is not None:
        MlflowBackend().fill_gaps("train/loss", result["history"])
        log_curve(result["dev_curve"], "sft")
    return {
        **result,
        **parameter_counts(network),
        "lora": model.lora is not None,
        "mesh": dict(mesh.shape),
        "base_model": base_model["path"],
    }


def check_sft_fits(
    base_model: dict,
    train_tokens: pd.DataFrame,
    tokenize_report: dict | None,
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
    tokenize: TokenizeParams,
    plan: PlanParams,
    preference: PreferenceParams = None,  # plain hints: Kedro validates one type a section
    grpo: GrpoParams = None,
    export: ExportParams = None,
    tracking: TrackingParams = None,
    eval_formatted: pd.DataFrame = None,
    eval_few_shot: pd.DataFrame = None,
    evaluate: EvaluateParams = None,
) -> tuple[dict, dict]:
    """The sft preflight: stops a run that cannot fit (memory: SFT's step, GRPO's phases, the scoring's generation;
    or this session's outputs on the profile's disk) before any weights are read, warns when it is risky.

    Passes `base_model` through, so the training node runs after it.
    """
    if not plan.enabled or sft.max_steps == 0:  # off, or no SFT this session
        return base_model, {"status": "skipped"}
    seq_len = len(train_tokens["input_tokens"].iloc[0]) if len(train_tokens) else None
    result = build_plan(model, sft, runtime, tokenize, plan, base_model.get("path"), seq_len, len(train_tokens),
                        tokenize_report=tokenize_report)
    # the fit is the compiled figure where the run's own compiler is at hand: XLA:TPU (an attached TPU, or a
    # profile's topology with libtpu), XLA:CPU on this CPU
    result = with_xla_check(result, model, plan, compiled_only=True)
    if export is not None and preference is not None and grpo is not None:  # this session's outputs only
        result = add_disk(result, plan_disk(
            result.job.arch, result.selected.setup, result.selected.hw,
            disk_sessions(model, {SFT.name: sft, PREFERENCE.name: preference, GRPO.name: grpo}, {},
                          result.job.max_steps), export, tracking, runtime.output_root,
        ))
    if result.status == "over":
        raise DoesNotFit(refusal(result))
    if grpo is not None and grpo.enabled:  # GRPO later in this session: stop now, not hours in, if it cannot fit
        result = stage_planning(GRPO).add_stage(result, PlannedStage(grpo), model, plan, runtime)
        if not result.polish[GRPO.name]["selected"]["fits"]:
            raise DoesNotFit(grpo_refusal(result))
    if evaluate is not None and eval_formatted is not None:  # the prompts' lengths size the samplers' caches
        tokenizer = load_tokenizer(base_model["path"])
        result = add_scoring(
            result, evaluate, evaluation.prompt_length(tokenizer, eval_formatted, eval_few_shot, evaluate),
            sft.dev_eval, sft.dev_eval and dev_eval.prompt_length(sft.dev_eval, tokenizer, eval_formatted))
        if refused := scoring_refusal(result):
            raise DoesNotFit(refused)
        if result.scoring:
            log.info("plan: scoring: %s", "; ".join(
                f"the {name} {p['gib']:.2f} GiB per device ({p['rows']} rows x {p['cache_positions']} cache positions)"
                for name, p in result.scoring.items()))
    for warning in result.warnings:  # the precision warning among them: updates that round away
        log.warning("plan: %s", warning)
    shares = (result.job.precision or {}).get("share_changed")
    if shares:
        log.info("plan: a step can change %.1f%% of the trained weights in %s at the peak learning rate, %.1f%% at "
                 "the schedule's end (%s)", 100 * shares["peak"], result.job.precision["param_dtype"],
                 100 * shares["end"], result.job.precision["magnitudes"])
    useful = result.goodput["useful_tokens_per_sec"]
    summary = result.summary()
    log.info("plan: %s on %s: %.2f GiB of %.2f GiB per device, about %.1f h, %s tokens/s%s%s",
             result.status, result.selected.profile, result.selected.peak / 2**30,
             result.selected.usable_bytes / 2**30, result.selected.hours, f"{result.goodput['tokens_per_sec']:,.0f}",
             "" if useful is None else f" ({useful:,.0f} of them useful)",
             _process_line(summary, result.selected.hw.process_gib))
    return base_model, summary


def _process_line(summary: dict, held: float) -> str:
    """On the CPU the run plans on: the process's resident peak in each stage and scoring phase planned
    (`summary`'s), its programs beside the `held` GiB it held when planned."""
    if summary["process_peak_gib"] is None:
        return ""
    peaks = {SFT.name: summary["process_peak_gib"], **{
        name: section["selected"].get("process_peak_gib") for name, section in summary.items()
        if isinstance(section, dict) and isinstance(section.get("selected"), dict)},
        **{name: phase["process_peak_gib"] for name, phase in summary.get("scoring", {}).items()}}
    text = ", ".join(f"{name} {gib:.1f}" for name, gib in peaks.items() if gib is not None)
    return f"; the process about {text} GiB resident ({held:.1f} held before its programs)"
