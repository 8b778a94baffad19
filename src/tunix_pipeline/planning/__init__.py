"""`plan`: memory per device, step time, session fit and cost of an SFT run, before any hardware is rented.

    from tunix_pipeline.planning import build_plan, markdown
    plan = build_plan(model, sft, runtime, tokenize, plan_params)   # no weights read, nothing compiled
    print(markdown(plan)); plan.status  # ok | risky | over

`check_against_xla(plan, ...)` adds XLA's own figure for the same train step, compiled ahead of time by the
compiler that will run it where it is at hand (XLA:TPU for a TPU profile's topology, XLA:CPU for this CPU), which
the plan then rests on; elsewhere on a fake CPU mesh of the same shape, to inform.
`planning.preference` and `planning.grpo` add the later stages (`grpo_xla` compiles GRPO's programs).
"""

from __future__ import annotations

import dataclasses

from tunix_pipeline.config import ModelParams, PlanParams, RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.models.architecture import Architecture, PlanError, from_hf_config, resolve
from tunix_pipeline.planning import precision
from tunix_pipeline.planning.goodput import padding_of
from tunix_pipeline.planning.hardware import detect_profile
from tunix_pipeline.planning.job import Job, make_job
from tunix_pipeline.planning.memory import MemoryEstimate, TrainSetup, estimate_memory
from tunix_pipeline.planning.plan import DoesNotFit, Plan, Row, make_plan
from tunix_pipeline.planning.polish import PlannedStage, stage_planning
from tunix_pipeline.planning.report import markdown, refusal
from tunix_pipeline.planning.xla_check import check_against_xla, with_xla_check

__all__ = [
    "Architecture",
    "DoesNotFit",
    "Job",
    "MemoryEstimate",
    "Plan",
    "PlanError",
    "PlannedStage",
    "Row",
    "TrainSetup",
    "build_plan",
    "check_against_xla",
    "with_xla_check",
    "stage_planning",
    "estimate_memory",
    "from_hf_config",
    "markdown",
    "refusal",
    "resolve",
    "selected_hardware",
]


def selected_hardware(plan: PlanParams, runtime: RuntimeParams | None = None):
    """(name, profile) of `plan.hardware`, or of the devices JAX sees when it is `auto`."""
    if plan.hardware == "auto":
        return detect_profile(plan, runtime)
    return plan.hardware, plan.profiles[plan.hardware]


def peak_flops_per_device(plan: PlanParams, runtime: RuntimeParams) -> float | None:
    """FLOP/s per device for the logged MFU: `runtime.peak_flops_per_device`, else the selected hardware
    profile's peak; None on devices no profile knows (the plan's stand-in peak is no figure to divide by)."""
    if runtime.peak_flops_per_device:
        return runtime.peak_flops_per_device
    name, hw = selected_hardware(plan, runtime)
    return hw.peak_tflops * 1e12 if name in plan.profiles else None


def precision_of(job: Job, model: ModelParams, sft: SftParams, plan: PlanParams, folder=None) -> dict:
    """The share of the trained weights a step can change in their dtype (`planning.precision`), from the base
    model's own weights where a folder of them is at hand."""
    magnitudes = None if job.mode != "full" else precision.weights_at_hand(folder, model.source, model.local_dir)
    return precision.update_precision(
        job.param_dtype, job.compute_dtype, job.optimizer, sft.learning_rate, sft.warmup_steps, sft.schedule,
        job.max_steps, lora=job.mode != "full", hidden_size=job.arch.hidden_size, magnitudes=magnitudes,
        warn_below=plan.warn_update_share,
    )


def build_plan(
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
    tokenize: TokenizeParams,
    plan: PlanParams,
    folder=None,
    seq_len: int | None = None,
    train_rows: int | None = None,
    compiled: dict | None = None,
    tokenize_report: dict | None = None,
) -> Plan:
    """The plan for the configured run; `folder`: the base model's folder when it is already there;
    `compiled`: XLA:TPU's figures for the selected run (`check_against_xla`), used in place of the estimate's;
    `tokenize_report`: the tokenize stage's report, for the padding (useful tokens, examples, epochs)."""
    arch = resolve(model, plan.architectures, folder)
    hardware = selected_hardware(plan, runtime)
    seq_len = seq_len or tokenize.max_length
    padding, note = padding_of(tokenize_report, tokenize.pack, seq_len)
    train_rows = train_rows or plan.train_rows or (padding.rows if padding else None)
    job = make_job(arch, model, sft, runtime, seq_len, hardware[1].devices, train_rows)
    job = dataclasses.replace(job, pack=tokenize.pack, padding=padding, padding_note=note,
                              train_examples=plan.train_examples)
    job = dataclasses.replace(job, precision=precision_of(job, model, sft, plan, folder))
    return make_plan(job, plan, hardware, compiled)
