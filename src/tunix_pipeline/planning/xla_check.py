"""The plan checked against XLA: the selected run's train step compiled ahead of time (`planning.xla`), its
peak memory and FLOPs beside the estimate's. Where the compiler that will run it is at hand (XLA:TPU for a TPU,
XLA:CPU for this CPU) the plan then rests on the compiled step's figures: the compiler is the truth, the estimate
a first answer."""

from __future__ import annotations

import re

from tunix_pipeline.config import ModelParams, PlanParams
from tunix_pipeline.planning import xla
from tunix_pipeline.planning.memory import GIB, estimate_memory
from tunix_pipeline.planning.plan import Plan, make_plan


def with_xla_check(result: Plan, model: ModelParams, plan: PlanParams, compiled_only: bool = False) -> Plan:
    """`result` checked against XLA; where the profile's own compiler is at hand the plan then rests on the
    compiled step's memory and FLOPs.

    `compiled_only`: skip the check unless that compiler is at hand (the sft preflight: the fake-mesh check for
    another accelerator only informs, and is slow).
    """
    if not plan.xla_check.enabled:
        return result
    if compiled_only:
        try:
            if xla.compile_target(result.selected.hw) is None:
                return result
        except Exception:  # noqa: BLE001 - reported by the check below
            pass
    checked = check_against_xla(result, model, plan.xla_check.max_layers, plan.xla_check.timeout_seconds)
    if checked.get("compiler"):
        result = make_plan(result.job, plan, (result.selected.profile, result.selected.hw), compiled=checked)
    elif checked.get("does_not_compile"):
        result.warnings.append(
            f"the train step does not compile for {checked['topology']}: {checked['error']}; "
            "the estimate above stands, but this program would fail there"
        )
        result.status = "risky" if result.status == "ok" else result.status
    result.xla = checked
    return result


def check_against_xla(plan: Plan, model: ModelParams, max_layers: int | None = 4, timeout: float = 900) -> dict:
    """XLA's peak (and FLOPs) for the selected run's train step, beside the estimate for that program.

    Where the profile's own compiler is at hand (`xla.compile_target`: a TPU profile's topology with libtpu
    installed, an attached TPU, or this CPU for the CPU profile), it compiles the run's own step for those devices,
    whose memory and FLOPs then replace the estimate's in the plan (`build_plan(..., compiled=...)`). Elsewhere (a
    GPU from here) the step is compiled on a fake CPU mesh, to inform only: the CPU has no bf16 matmul (XLA computes
    bf16 models in float32 there, keeping a mixture of both), so bf16 runs are checked as the same step in float32;
    XLA:CPU keeps the activations under remat anyway, so remat runs are checked as the step without it.
    """
    s = plan.selected.setup
    out = {"mesh": s.mesh, "target": plan.selected.hw.kind}
    try:
        target = xla.compile_target(plan.selected.hw)
    except Exception as err:  # noqa: BLE001 - e.g. a topology libtpu does not know: the estimate stands
        return {**out, "error": f"{type(err).__name__}: {err}"}
    if target is not None:
        name, devices = target
        compiler = f"XLA:{devices[0].platform.upper()}"
        estimate = estimate_memory(plan.job.arch, s).peak
        out.update(dtype=s.param_dtype, dtype_note=None, estimate_gib=estimate / GIB, topology=name)
        try:
            result = xla.xla_peak(plan.job.arch, s, max_layers, model.lora, devices)
        except Exception as err:  # noqa: BLE001 - a sharding error, an unsupported op: the program itself fails
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            # XLA:TPU refuses a program whose buffers exceed the chip's HBM, saying how much it needs
            needed = re.search(r"Ran out of memory.*?\(([\d.]+)G\) exceeds", message)
            if needed:
                return {**out, "error": message, "out_of_memory": True, "xla_gib": float(needed.group(1)),
                        "platform": "tpu", "compiler": compiler, "method": "refused by XLA:TPU", "difference": None,
                        "flops_per_device": None}
            return {**out, "error": f"{compiler}: {type(err).__name__}: {message}", "does_not_compile": True}
        mode = "full" if s.mode == "full" else "lora"
        analytic = plan.job.arch.train_flops_per_token(s.seq_len, mode, s.remat) * s.per_device_batch * s.seq_len / s.tp
        return {**out, **_compiled(result, estimate), "compiler": compiler, "flops_per_device": result["flops"],
                "flops_estimate_per_device": analytic}
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
    estimate = estimate_memory(plan.job.arch, check).peak
    out.update(mesh=check.mesh, dtype=check.param_dtype, dtype_note="; ".join(notes) or None, estimate_gib=estimate / GIB)
    try:
        result = xla.check(plan.job.arch, check, max_layers, model.lora, timeout)
    except Exception as err:  # noqa: BLE001 - the check informs; the estimate stands without it
        return {**out, "error": f"{type(err).__name__}: {err}"}
    return {**out, **_compiled(result, estimate)}


def _compiled(result: dict, estimate: float) -> dict:
    return {
        "method": result["method"],
        "platform": result["platform"],
        "seconds": result["seconds"],
        "xla_gib": result["peak"] / GIB,
        "difference": (estimate - result["peak"]) / result["peak"],
    }
