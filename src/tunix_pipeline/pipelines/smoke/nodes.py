from tunix_pipeline.run.paths import storage_path
from tunix_pipeline.stages import POLISH, SFT

MAX_LOSS_RATIO = 0.6


def check_smoke(exported_model: dict, eval_metrics: dict, **stage_outputs: dict) -> dict:
    """The smoke run's pass criteria; raises (failing the run) when one is missed. `stage_outputs` holds every
    stage's result and every polish stage's evaluation metrics, by dataset name."""
    sft_result = stage_outputs[SFT.result]
    first, last = sft_result["first_loss"], sft_result["last_loss"]
    checkpoint = storage_path(sft_result["checkpoint_dir"]) / str(sft_result["latest_step"])
    checks = {
        "loss_dropped": first is not None and last <= MAX_LOSS_RATIO * first,
        "checkpoint_written": checkpoint.is_dir(),
        "tuned_model_evaluated": "eval_loss" in eval_metrics.get("tuned", {}),
        "exported": (storage_path(exported_model["path"]) / "config.json").is_file(),
    }
    ran = {}
    for stage in POLISH:  # a stage that trained: a checkpoint, its curves every step, its policy evaluated
        result = stage_outputs[stage.result]
        ran[stage.name] = bool(result.get("enabled"))
        if not ran[stage.name]:
            continue
        history = result.get("history") or []
        checks[f"{stage.name}_checkpoint_written"] = (
            storage_path(result["checkpoint_dir"]) / str(result["latest_step"])).is_dir()
        checks[f"{stage.name}_curves_logged"] = bool(history) and all(
            h.get(key) is not None for h in history for key in stage.history_keys)
        checks[f"{stage.name}_model_evaluated"] = "eval_loss" in stage_outputs[stage.eval_outputs()[0]].get(stage.name, {})
    last_trained = next((stage.name for stage in reversed(POLISH) if ran[stage.name]), SFT.name)
    checks["last_trained_policy_exported"] = exported_model.get("stage") == last_trained
    preference, grpo = (stage_outputs.get(f"{name}_result") or {} for name in ("preference", "grpo"))
    report = {
        "passed": all(checks.values()),
        "checks": checks,
        "first_loss": first,
        "last_loss": last,
        "loss_ratio": last / first if first else None,
        "checkpoint": str(checkpoint),
        "stages_trained": ran,
        "skipped_stages": exported_model.get("skipped_stages", {}),
        "preference_heldout_pair_accuracy": [preference.get("heldout_pair_accuracy_before"),
                                             preference.get("heldout_pair_accuracy")],
        "grpo_first_reward": grpo.get("first_reward"),
        "grpo_last_reward": grpo.get("last_reward"),
        "exported_model": exported_model["path"],
    }
    if not report["passed"]:
        failed = [name for name, ok in checks.items() if not ok]
        raise AssertionError(f"smoke checks failed: {failed}; details: {report}")
    return report
