from pathlib import Path

MAX_LOSS_RATIO = 0.6


def check_smoke(sft_result: dict, eval_metrics: dict, exported_model: dict) -> dict:
    """The smoke run's pass criteria; raises (failing the run) when one is missed."""
    first, last = sft_result["first_loss"], sft_result["last_loss"]
    checkpoint = Path(sft_result["checkpoint_dir"]) / str(sft_result["latest_step"])
    checks = {
        "loss_dropped": first is not None and last <= MAX_LOSS_RATIO * first,
        "checkpoint_written": checkpoint.is_dir(),
        "tuned_model_evaluated": "eval_loss" in eval_metrics.get("tuned", {}),
        "exported": (Path(exported_model["path"]) / "config.json").is_file(),
    }
    report = {
        "passed": all(checks.values()),
        "checks": checks,
        "first_loss": first,
        "last_loss": last,
        "loss_ratio": last / first if first else None,
        "checkpoint": str(checkpoint),
        "exported_model": exported_model["path"],
    }
    if not report["passed"]:
        failed = [name for name, ok in checks.items() if not ok]
        raise AssertionError(f"smoke checks failed: {failed}; details: {report}")
    return report
