"""`plan`: memory per device, step time, session fit and cost of an SFT run, before any hardware is rented.

    from tunix_pipeline.planning import build_plan, markdown
    plan = build_plan(model, sft, runtime, tokenize, plan_params)   # no weights read, nothing compiled
    print(markdown(plan)); plan.status  # ok | risky | over

`check_against_xla(plan, ...)` adds XLA's own figure for the same train step,
compiled ahead of time on a fake CPU mesh of the same shape.
"""

from __future__ import annotations

from tunix_pipeline.config import ModelParams, PlanParams, RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.planning.architecture import Architecture, PlanError, from_hf_config, resolve
from tunix_pipeline.planning.memory import GIB, MemoryEstimate, TrainSetup, estimate_memory
from tunix_pipeline.planning.plan import DoesNotFit, Job, Plan, Row, detect_profile, make_job, make_plan, refusal
from tunix_pipeline.planning.report import markdown

__all__ = [
    "Architecture",
    "DoesNotFit",
    "Job",
    "MemoryEstimate",
    "Plan",
    "PlanError",
    "Row",
    "TrainSetup",
    "build_plan",
    "check_against_xla",
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


def build_plan(
    model: ModelParams,
    sft: SftParams,
    runtime: RuntimeParams,
    tokenize: TokenizeParams,
    plan: PlanParams,
    folder=None,
    seq_len: int | None = None,
    train_rows: int | None = None,
) -> Plan:
    """The plan for the configured run; `folder`: the base model's folder when it is already there."""
    arch = resolve(model, plan.architectures, folder)
    hardware = selected_hardware(plan, runtime)
    job = make_job(arch, model, sft, runtime, seq_len or tokenize.max_length, hardware[1].devices,
                   train_rows or plan.train_rows)
    return make_plan(job, plan, hardware)


def check_against_xla(plan: Plan, model: ModelParams, max_layers: int | None = 4, timeout: float = 900) -> dict:
    """XLA's peak for the selected run's train step on a fake CPU mesh, beside the estimate for that program.

    The CPU has no bf16 matmul (XLA computes bf16 models in float32 there, keeping a
    mixture of both), so bf16 runs are checked as the same step in float32; XLA:CPU keeps
    the activations under remat anyway, so remat runs are checked as the step without it.
    """
    from tunix_pipeline.planning import xla

    s = plan.selected.setup
    check = s.replace(backend="cpu")
    notes = []
    if s.param_dtype != "float32" or s.compute_dtype:
        check = check.replace(param_dtype="float32", compute_dtype=None)
        notes.append(f"the {s.compute_dtype or s.param_dtype} step compiled in float32: the CPU has no bf16 matmul")
    if s.remat != "none":
        # XLA:CPU's buffer assignment keeps the activations under remat all the same (Qwen2.5-0.5B, 4 x 1000
        # tokens: ~940 MiB per layer with sft.remat: decoder, ~1010 MiB without), so a remat step would be
        # compared with a program that does not remat; the estimate's remat term stands unchecked
        check = check.replace(remat="none")
        notes.append(f"compiled without remat ({s.remat}): XLA:CPU keeps the activations under remat anyway")
    note = "; ".join(notes) or None
    estimate = estimate_memory(plan.job.arch, check).peak
    out = {"mesh": check.mesh, "dtype": check.param_dtype, "dtype_note": note, "estimate_gib": estimate / GIB,
           "target": plan.selected.hw.kind}
    try:
        result = xla.check(plan.job.arch, check, max_layers, model.lora, timeout)
    except Exception as err:  # noqa: BLE001 - the check informs; the estimate stands without it
        return {**out, "error": f"{type(err).__name__}: {err}"}
    peak = result["peak"]
    return {
        **out,
        "method": result["method"],
        "platform": result["platform"],
        "seconds": result["seconds"],
        "xla_gib": peak / GIB,
        "difference": (estimate - peak) / peak,
    }
