from tunix_pipeline.paths import storage_path

MAX_LOSS_RATIO = 0.6


def check_smoke(
    sft_result: dict, eval_metrics: dict, preference_result: dict, preference_eval_metrics: dict, grpo_result: dict,
    grpo_eval_metrics: dict, exported_model: dict
) -> dict:
    """The smoke run's pass criteria; raises (failing the run) when one is missed."""
    first, last = sft_result["first_loss"], sft_result["last_loss"]
    checkpoint = storage_path(sft_result["checkpoint_dir"]) / str(sft_result["latest_step"])
    checks = {
        "loss_dropped": first is not None and last <= MAX_LOSS_RATIO * first,
        "checkpoint_written": checkpoint.is_dir(),
        "tuned_model_evaluated": "eval_loss" in eval_metrics.get("tuned", {}),
        "exported": (storage_path(exported_model["path"]) / "config.json").is_file(),
    }
    preference_ran = bool(preference_result.get("enabled"))
    if preference_ran:  # a few preference steps: its curves, a checkpoint, held-out pairs scored, the policy evaluated
        history = preference_result.get("history") or []
        checks["preference_checkpoint_written"] = (
            storage_path(preference_result["checkpoint_dir"]) / str(preference_result["latest_step"])
        ).is_dir()
        checks["preference_curves_logged"] = bool(history) and all(h.get("rewards/margin") is not None for h in history)
        checks["preference_pairs_scored"] = preference_result.get("heldout_pair_accuracy") is not None
        checks["preference_model_evaluated"] = "eval_loss" in preference_eval_metrics.get("preference", {})
    grpo_ran = bool(grpo_result.get("enabled"))
    if grpo_ran:  # a few GRPO steps: rewards and KL logged, a checkpoint, and the policy evaluated
        history = grpo_result.get("history") or []
        checks["grpo_checkpoint_written"] = (storage_path(grpo_result["checkpoint_dir"]) / str(grpo_result["latest_step"])).is_dir()
        checks["grpo_rewards_logged"] = bool(history) and all(h.get("reward") is not None for h in history)
        checks["grpo_model_evaluated"] = "eval_loss" in grpo_eval_metrics.get("grpo", {})
        checks["grpo_model_exported"] = exported_model.get("stage") == "grpo"
    report = {
        "passed": all(checks.values()),
        "checks": checks,
        "first_loss": first,
        "last_loss": last,
        "loss_ratio": last / first if first else None,
        "checkpoint": str(checkpoint),
        "preference_ran": preference_ran,
        "preference_heldout_pair_accuracy": [preference_result.get("heldout_pair_accuracy_before"),
                                             preference_result.get("heldout_pair_accuracy")],
        "grpo_ran": grpo_ran,
        "skipped_stages": exported_model.get("skipped_stages", {}),
        "grpo_first_reward": grpo_result.get("first_reward"),
        "grpo_last_reward": grpo_result.get("last_reward"),
        "exported_model": exported_model["path"],
    }
    if not report["passed"]:
        failed = [name for name, ok in checks.items() if not ok]
        raise AssertionError(f"smoke checks failed: {failed}; details: {report}")
    return report
