"""Policies measured side by side on the eval split: the base model against SFT's (`evaluate_models`), and each
polish stage against the policy it started from (`evaluate_after`), with the judge and lm-evaluation-harness
where they are on."""

import functools
import hashlib
import json
import logging

import jax
import pandas as pd

from tunix_pipeline.config import EvaluateParams, ModelParams, RuntimeParams
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.data.formatting import few_shot_label
from tunix_pipeline.evaluate import evaluation
from tunix_pipeline.evaluate import harness as harness_lib
from tunix_pipeline.models import load_run_model, load_tokenizer
from tunix_pipeline.stages import SFT, Stage, selected_step
from tunix_pipeline.train.checkpoints import restore_required
from tunix_pipeline.train.judge import Judge

log = logging.getLogger(__name__)


def _evaluator(eval_tokens, eval_formatted, base_model, sft_result, model, params, runtime):
    mesh = make_mesh(runtime)
    judge = _judge(params, mesh)  # a judge source that cannot resolve fails before the policy loads
    tokenizer = load_tokenizer(base_model["path"])
    # a QLoRA run is evaluated on its full-precision base, as it is exported
    network, _ = load_run_model(base_model["path"], model, mesh, quantize=False)
    # the eval loss in SFT's micro-batches: rows of SFT's length that fit with their gradients fit without
    loss_batch_size = sft_result.get("micro_batch_size") or sft_result["global_batch_size"]
    return network, evaluation.Evaluator(network, tokenizer, mesh, params, eval_tokens, eval_formatted, loss_batch_size,
                                         judge, runtime.decode_weights)


def _judge(params: EvaluateParams, mesh):
    """The judge (its model loads on first use), one per evaluation node; None without `evaluate.judge`."""
    if params.judge is None:
        return None

    return Judge(params.judge, mesh)


def _harness(network, evaluator, base_model, eval_formatted, params: EvaluateParams):
    """lm-eval over the same loaded model (weights restored in place), or None when `harness.enabled` is off."""
    if not params.harness.enabled:
        return None
    return harness_lib.Harness(network, evaluator.tokenizer, evaluator.mesh, params.harness, base_model["path"], eval_formatted)


def _with_harness(results: dict, report: str, harness_results: dict, delta: tuple[str, str]) -> str:
    """lm-eval's scores beside ours: a report section, and `harness` in the metrics (its settings under
    `lm_eval`, which MLflow gets as parameters)."""
    if not harness_results:
        return report
    labels = list(harness_results)
    results["harness"] = {label: harness_results[label]["scores"] for label in labels}
    results["harness"]["lm_eval"] = harness_results[labels[0]]["settings"]
    return report + "\n" + harness_lib.report(harness_results, delta=delta if set(delta) <= set(labels) else None)


def _few_shot(evaluator, eval_few_shot: pd.DataFrame, params: EvaluateParams, base_scored: bool):
    """The evaluator on the k-shot prompts (`evaluate.few_shot`), or None when no model here is scored on them."""
    wanted = params.few_shot and (base_scored or params.few_shot_models == "all")
    return evaluator.on_prompts(eval_few_shot) if wanted else None


def scored_by(base_model: dict, checkpoint_dir, step: int | None, model: ModelParams, params: EvaluateParams,
              runtime: RuntimeParams) -> str | None:
    """A digest of what a policy's generations depend on: the base weights, the checkpoint as Orbax committed it
    (folder, step, commit time: a checkpoint saved again at the same step is another), every model and evaluation
    setting, and the devices' layout; None for a checkpoint without a readable commit record (its rows are then
    generated, never taken)."""
    checkpoint = None
    if checkpoint_dir is not None:
        record = storage_path(checkpoint_dir) / str(step) / "_CHECKPOINT_METADATA"
        try:
            committed = json.loads(record.read_text()).get("commit_timestamp_nsecs")
        except (OSError, ValueError, AttributeError):
            committed = None
        if committed is None:
            return None
        checkpoint = [str(storage_path(checkpoint_dir)), step, committed]
    key = {"base": base_model["path"], "checkpoint": checkpoint, "model": model.model_dump(mode="json"),
           "evaluate": params.model_dump(mode="json", exclude={"harness", "generations_dir"}),
           "devices": [jax.device_count(), runtime.model_dump(mode="json", include={"mesh", "decode_weights"})]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _measure(label: str, evaluator, few_shot, results: dict, samples: dict, params: EvaluateParams,
             digest: str | None = None, earlier: pd.DataFrame | None = None) -> None:
    """`label`'s scores, and its k-shot ones beside them where `evaluate.few_shot` applies to it; `digest` (its
    `scored_by`) and `earlier`: `Evaluator.measure`'s."""
    results[label], samples[label] = evaluator.measure(label, digest, earlier)
    if few_shot is not None and (label == "base" or params.few_shot_models == "all"):
        shot = few_shot_label(label, params.few_shot)
        results[shot], samples[shot] = few_shot.measure(shot, digest, earlier)


def _empty_split(eval_tokens: pd.DataFrame, eval_formatted: pd.DataFrame) -> bool:
    if len(eval_tokens) or len(eval_formatted):
        return False
    log.warning("evaluate: the eval split is empty; set `ingest.eval_fraction` above 0 to evaluate")
    return True


def evaluate_models(
    eval_tokens: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    eval_few_shot: pd.DataFrame,
    base_model: dict,
    sft_result: dict,
    model: ModelParams,
    params: EvaluateParams,
    runtime: RuntimeParams,
):
    """The same metrics for the base and the fine-tuned model: loss on the eval rows, generation on a few; with
    `evaluate.few_shot`, the base shown k solved examples too (`eval_few_shot`), and the tuned model paired against
    both."""
    curve = evaluation.training_curves({SFT.name: sft_result.get("history")})
    evaluation.log_figure(curve, "loss_curve.png")
    if _empty_split(eval_tokens, eval_formatted):
        reason = "the eval split is empty (set `ingest.eval_fraction` above 0)"
        return {"empty_eval_split": True}, pd.DataFrame(columns=evaluation.SAMPLE_COLUMNS), evaluation.empty_report(reason), curve
    if params.harness.enabled:
        harness_lib.check(params.harness)  # before any weights load
    network, evaluator = _evaluator(eval_tokens, eval_formatted, base_model, sft_result, model, params, runtime)
    harness = _harness(network, evaluator, base_model, eval_formatted, params)
    few_shot = _few_shot(evaluator, eval_few_shot, params, base_scored=params.compare_base_model)
    results, samples, harness_results = {}, {}, {}
    if params.compare_base_model:
        _measure("base", evaluator, few_shot, results, samples, params,
                 scored_by(base_model, None, None, model, params, runtime))
        if harness:
            harness_results["base"] = harness.measure("base")
    step = restore_required(network, storage_path(sft_result["checkpoint_dir"]), SFT.name, "evaluate",
                            selected_step(sft_result))
    _measure("tuned", evaluator, few_shot, results, samples, params,
             scored_by(base_model, sft_result["checkpoint_dir"], step, model, params, runtime))
    results["tuned"]["checkpoint_step"] = step
    if harness:
        harness_results["tuned"] = harness.measure("tuned")
        harness.close()
    evaluation.with_paired(results, samples, "base", "tuned")
    if few_shot is not None:
        shot = functools.partial(few_shot_label, k=params.few_shot)
        evaluation.with_paired(results, samples, shot("base"), "tuned", key="paired_few_shot")
        evaluation.with_paired(results, samples, shot("base"), shot("tuned"))
    report = "# Evaluation\n\n" + evaluation.score_table(results) + "\n"
    report += evaluation.markdown_table(results, delta=("base", "tuned") if "base" in results else None)
    report += evaluation.open_ended_note(results)
    report = _with_harness(results, report, harness_results, ("base", "tuned"))
    return results, pd.concat(samples.values(), ignore_index=True), report, curve


def evaluate_after(stage: Stage):
    """The node that measures a polish stage's policy beside the policy it started from (its parent's: SFT's, or
    the preference stage's), both here (one compiled sampler serves both), so the stage's pipeline runs from a
    checkpoint alone; the base model is in the first evaluation's report, and paired against here when its samples
    (`eval_samples`) are there."""
    def evaluate_after_stage(
        eval_tokens: pd.DataFrame,
        eval_formatted: pd.DataFrame,
        eval_few_shot: pd.DataFrame,
        eval_samples: pd.DataFrame | None,
        base_model: dict,
        sft_result: dict,
        result: dict,
        model: ModelParams,
        params: EvaluateParams,
        runtime: RuntimeParams,
    ):
        title = result.get("title", stage.title)
        curve = evaluation.training_curves({SFT.name: sft_result.get("history"), stage.name: result.get("history")},
                                           titles={stage.name: title})
        evaluation.log_figure(curve, f"{stage.name}_curves.png")
        return (*_after_stage(stage, title, eval_tokens, eval_formatted, eval_few_shot, eval_samples, base_model,
                              sft_result, result, model, params, runtime), curve)

    evaluate_after_stage.__name__ = evaluate_after_stage.__qualname__ = f"evaluate_after_{stage.name}"
    return evaluate_after_stage


def _after_stage(stage: Stage, title, eval_tokens, eval_formatted, eval_few_shot, eval_samples, base_model, sft_result,
                 result, model, params, runtime):
    """(metrics, samples, report) of the stage's policy against the policy it started from, and against the base
    as the first evaluation scored it (`eval_samples`, when that evaluation has run: zero-shot and k-shot)."""
    empty = pd.DataFrame(columns=evaluation.SAMPLE_COLUMNS)
    if result.get("skipped"):
        return ({f"{stage.name}_skipped": True, "skip_reason": result["skip_reason"]}, empty,
                evaluation.empty_report(f"{title} was skipped: {result['skip_reason']}"))
    if not result.get("enabled"):
        return ({f"{stage.name}_enabled": False}, empty,
                evaluation.empty_report(f"{title} is off (`{stage.name}.enabled: false`)"))
    if _empty_split(eval_tokens, eval_formatted):
        reason = "the eval split is empty (set `ingest.eval_fraction` above 0)"
        return {"empty_eval_split": True}, empty, evaluation.empty_report(reason)
    if params.harness.enabled:
        harness_lib.check(params.harness)  # before any weights load
    network, evaluator = _evaluator(eval_tokens, eval_formatted, base_model, sft_result, model, params, runtime)
    harness = _harness(network, evaluator, base_model, eval_formatted, params)
    few_shot = _few_shot(evaluator, eval_few_shot, params, base_scored=False)
    start = result["start_stage"]  # the policy it started from, labelled with the stage that trained it
    results, samples, harness_results = {}, {}, {}
    # each at the step handed on: its dev-selected one (`dev_eval`), else the latest
    for label, checkpoint_dir, selected in ((start, result["start_checkpoint_dir"], result.get("start_selected")),
                                            (stage.name, result["checkpoint_dir"], selected_step(result))):
        step = restore_required(network, storage_path(checkpoint_dir), label, "evaluate", selected)
        # the policy it started from is often SFT's as the first evaluation scored it: its rows are taken from there
        _measure(label, evaluator, few_shot, results, samples, params,
                 scored_by(base_model, checkpoint_dir, step, model, params, runtime), eval_samples)
        results[label]["checkpoint_step"] = step
        if harness:
            harness_results[label] = harness.measure(label)
    if harness:
        harness.close()
    for before, after in stage.own_figures:  # what the stage measured on both policies, beside the evaluation's
        if after in result:
            results[stage.name][after], results[start][after] = result[after], result[before]
    evaluation.with_paired(results, samples, start, stage.name)
    if few_shot is not None:  # k-shot against k-shot, where every model is scored both ways
        shot = functools.partial(few_shot_label, k=params.few_shot)
        evaluation.with_paired(results, samples, shot(start), shot(stage.name))
    _paired_against_the_base(results, samples, stage.name, eval_samples, params)
    report = f"# Evaluation after {title}\n\n" + evaluation.score_table(results) + "\n"
    report += evaluation.markdown_table(results, delta=(start, stage.name))
    report += evaluation.open_ended_note(results)
    if result.get("evaluation_note"):
        report += f"\n{result['evaluation_note']}\n"
    if results[start].get("generations_reused"):
        report += (f"\n{start}'s generations are the first evaluation's (`eval_samples`: the same checkpoint, "
                   "settings and prompts), not generated again.\n")
    report = _with_harness(results, report, harness_results, (start, stage.name))
    return results, pd.concat(samples.values(), ignore_index=True), report


def _paired_against_the_base(results: dict, samples: dict, label: str, eval_samples: pd.DataFrame | None,
                             params: EvaluateParams) -> None:
    """A polish stage's policy paired against the base zero-shot and k-shot, from the first evaluation's samples."""
    if eval_samples is None or not len(eval_samples):
        return
    bases = [("base", "paired_base")] + ([(few_shot_label("base", params.few_shot), "paired_few_shot")]
                                         if params.few_shot else [])
    for base, key in bases:
        rows = eval_samples[eval_samples["model"] == base]
        evaluation.with_paired(results, samples, base, label, key=key, parent_samples=rows)
