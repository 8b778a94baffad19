from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.stages import SFT, STAGES, Stage, StageResult

MAX_LOSS_RATIO = 0.6


def check_smoke(exported_model: dict, eval_metrics: dict, **stage_outputs: dict) -> dict:
    """The smoke run's pass criteria; raises (failing the run) when one is missed. `stage_outputs` holds every
    stage's result and every polish stage's evaluation metrics, by dataset name."""
    sft_result = stage_outputs[SFT.result]
    first, last = sft_result["first_loss"], sft_result["last_loss"]
    checks = {"loss_dropped": first is not None and last <= MAX_LOSS_RATIO * first}
    ran, curves = {}, {}
    for stage in STAGES:  # a stage that trained: a checkpoint, its curves every step, its policy evaluated
        result = stage_outputs[stage.result]
        ran[stage.name] = stage is SFT or bool(result.get("enabled"))
        if ran[stage.name]:
            # the first stage is evaluated against the base model (`eval_metrics`), a polish stage after it trains
            evaluated = eval_metrics.get("tuned", {}) if stage is SFT else \
                stage_outputs[stage.eval_outputs()[0]].get(stage.name, {})
            checks.update(_stage_checks(stage, result, evaluated))
            curves[stage.name] = _first_and_last(stage, result)
    checks["exported"] = (storage_path(exported_model["path"]) / "config.json").is_file()
    last_trained = next(stage.name for stage in reversed(STAGES) if ran[stage.name])
    checks["last_trained_policy_exported"] = exported_model.get("stage") == last_trained
    report = {
        "passed": all(checks.values()),
        "checks": checks,
        "first_loss": first,
        "last_loss": last,
        "loss_ratio": last / first if first else None,
        "checkpoint": str(_checkpoint(sft_result)),
        "stages_trained": ran,
        "skipped_stages": exported_model.get("skipped_stages", {}),
        "curves": curves,  # each trained stage's history keys at its first and last step
        "exported_model": exported_model["path"],
    }
    if not report["passed"]:
        failed = [name for name, ok in checks.items() if not ok]
        raise AssertionError(f"smoke checks failed: {failed}; details: {report}")
    return report


def _checkpoint(result: StageResult):
    return storage_path(result["checkpoint_dir"]) / str(result["latest_step"])


def _stage_checks(stage: Stage, result: StageResult, evaluated: dict) -> dict[str, bool]:
    history = result.get("history") or []
    return {
        f"{stage.name}_checkpoint_written": _checkpoint(result).is_dir(),
        f"{stage.name}_curves_logged": bool(history) and all(
            h.get(key) is not None for h in history for key in stage.history_keys),
        f"{stage.name}_model_evaluated": "eval_loss" in evaluated,
    }


def _first_and_last(stage: Stage, result: StageResult) -> dict[str, list]:
    history = result.get("history") or [{}]
    return {key: [history[0].get(key), history[-1].get(key)] for key in stage.history_keys}
