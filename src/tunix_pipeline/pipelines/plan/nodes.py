import logging

import pandas as pd

from tunix_pipeline.config import ModelParams, PlanParams, RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.planning import DoesNotFit, build_plan, markdown, refusal, with_xla_check

log = logging.getLogger(__name__)


def plan_training(
    model: ModelParams, sft: SftParams, runtime: RuntimeParams, tokenize: TokenizeParams, plan: PlanParams
) -> tuple[dict, str]:
    """The plan for every hardware profile, checked against XLA (on a TPU profile: compiled for its
    topology, and resting on that); printed, and returned as JSON and Markdown."""
    result = with_xla_check(build_plan(model, sft, runtime, tokenize, plan), model, plan)
    text = markdown(result)
    print(text)  # noqa: T201 - the table is this pipeline's output
    return result.summary(), text


def check_sft_fits(
    base_model: dict,
    train_tokens: pd.DataFrame,
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
    tokenize: TokenizeParams,
    plan: PlanParams,
) -> tuple[dict, dict]:
    """The sft preflight: stops a run that cannot fit before any weights are read, warns when it is risky.

    Passes `base_model` through, so the training node runs after it.
    """
    if not plan.enabled or sft.max_steps == 0:  # off, or no SFT this session
        return base_model, {"status": "skipped"}
    seq_len = len(train_tokens["input_tokens"].iloc[0]) if len(train_tokens) else None
    result = build_plan(model, sft, runtime, tokenize, plan, base_model.get("path"), seq_len, len(train_tokens))
    # on a TPU (attached, or a profile's topology with libtpu) the fit is XLA:TPU's compiled figure
    result = with_xla_check(result, model, plan, tpu_only=True)
    if result.status == "over":
        raise DoesNotFit(refusal(result))
    for warning in result.warnings:
        log.warning("plan: %s", warning)
    log.info("plan: %s on %s: %.2f GiB of %.2f GiB per device, about %.1f h",
             result.status, result.selected.profile, result.selected.peak / 2**30,
             result.selected.usable_bytes / 2**30, result.selected.hours)
    return base_model, result.summary()
