import logging

import pandas as pd

from tunix_pipeline import evaluation
from tunix_pipeline.config import EvaluateParams, ModelParams, RuntimeParams
from tunix_pipeline.models import load_run_model, load_tokenizer
from tunix_pipeline.training import make_mesh, restore_required

log = logging.getLogger(__name__)


def _evaluator(eval_tokens, eval_formatted, base_model, sft_result, model, params, runtime):
    mesh = make_mesh(runtime)
    tokenizer = load_tokenizer(base_model["path"])
    # a QLoRA run is evaluated on its full-precision base, as it is exported
    network, _ = load_run_model(base_model["path"], model, mesh, quantize=False)
    batch_size = sft_result.get("micro_batch_size") or sft_result["global_batch_size"]
    return network, evaluation.Evaluator(network, tokenizer, mesh, params, eval_tokens, eval_formatted, batch_size)


def _empty_split(eval_tokens: pd.DataFrame, eval_formatted: pd.DataFrame) -> bool:
    if len(eval_tokens) or len(eval_formatted):
        return False
    log.warning("evaluate: the eval split is empty; set `ingest.eval_fraction` above 0 to evaluate")
    return True


def evaluate_models(
    eval_tokens: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    sft_result: dict,
    model: ModelParams,
    params: EvaluateParams,
    runtime: RuntimeParams,
):
    """The same metrics for the base and the fine-tuned model: loss on the eval rows, generation on a few."""
    curve = evaluation.training_curves(sft_result.get("loss_history"))
    evaluation.log_figure(curve, "loss_curve.png")
    if _empty_split(eval_tokens, eval_formatted):
        reason = "the eval split is empty (set `ingest.eval_fraction` above 0)"
        return {"empty_eval_split": True}, pd.DataFrame(columns=evaluation.SAMPLE_COLUMNS), evaluation.empty_report(reason), curve
    network, evaluator = _evaluator(eval_tokens, eval_formatted, base_model, sft_result, model, params, runtime)
    results, samples = {}, []
    if params.compare_base_model:
        results["base"], base_samples = evaluator.measure("base")
        samples.append(base_samples)
    step = restore_required(network, sft_result["checkpoint_dir"], "sft", "evaluate")
    results["tuned"], tuned_samples = evaluator.measure("tuned")
    results["tuned"]["checkpoint_step"] = step
    samples.append(tuned_samples)
    report = "# Evaluation\n\n" + evaluation.markdown_table(results, delta=("base", "tuned") if "base" in results else None)
    return results, pd.concat(samples, ignore_index=True), report, curve


def evaluate_after_grpo(
    eval_tokens: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    sft_result: dict,
    grpo_result: dict,
    model: ModelParams,
    params: EvaluateParams,
    runtime: RuntimeParams,
):
    """The GRPO policy beside the SFT checkpoint it started from, to see what GRPO gained or lost.

    Both are measured here (one compiled sampler serves both), so the `grpo` pipeline runs
    from an SFT checkpoint alone; the base model is in the first evaluation's report.
    """
    curve = evaluation.training_curves(sft_result.get("loss_history"), grpo_result.get("history"))
    evaluation.log_figure(curve, "grpo_curves.png")
    empty = pd.DataFrame(columns=evaluation.SAMPLE_COLUMNS)
    if not grpo_result.get("enabled"):
        return {"grpo_enabled": False}, empty, evaluation.empty_report("GRPO is off (`grpo.enabled: false`)"), curve
    if _empty_split(eval_tokens, eval_formatted):
        reason = "the eval split is empty (set `ingest.eval_fraction` above 0)"
        return {"empty_eval_split": True}, empty, evaluation.empty_report(reason), curve
    network, evaluator = _evaluator(eval_tokens, eval_formatted, base_model, sft_result, model, params, runtime)
    results, samples = {}, []
    for label, stage, checkpoint_dir in (
        ("tuned", "sft", grpo_result["sft_checkpoint_dir"]),
        ("grpo", "grpo", grpo_result["checkpoint_dir"]),
    ):
        step = restore_required(network, checkpoint_dir, stage, "evaluate")
        results[label], rows = evaluator.measure(label)
        results[label]["checkpoint_step"] = step
        samples.append(rows)
    report = "# Evaluation after GRPO\n\n" + evaluation.markdown_table(results, delta=("tuned", "grpo"))
    if grpo_result.get("reward_trend"):
        rewards = ", ".join(f"{h['reward']:.2f}" for h in grpo_result["history"] if h.get("reward") is not None)
        report += f"\nGRPO's {grpo_result['reward_trend']['summary']} ({rewards}).\n"
    return results, pd.concat(samples, ignore_index=True), report, curve
