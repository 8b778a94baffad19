"""The plan as Markdown: what is printed, written to plan.md and logged to MLflow."""

from __future__ import annotations

from tunix_pipeline.planning import scoring
from tunix_pipeline.planning.goodput import hours_text as _hours
from tunix_pipeline.planning.goodput import markdown_lines as goodput_lines
from tunix_pipeline.planning.memory import GIB
from tunix_pipeline.planning.plan import Plan, Row, process_peak_gib, size
from tunix_pipeline.planning.polish import stage_planning
from tunix_pipeline.stages import POLISH


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:,.2f}"


def _row(r: Row, selected: str, recommended: str | None) -> str:
    s = r.setup
    mark = " **(this run)**" if r.profile == selected else ""
    xla = f" ({r.compiled_by})" if r.compiled_peak is not None else ""
    mark += " **(recommended)**" if r.profile == recommended else ""
    fits = f"{r.memory_fraction:.0%}" if r.fits else f"**no** ({r.memory_fraction:.0%})"
    sessions = "-" if r.steps_per_session is None else (str(r.sessions) if r.sessions else "never")
    if r.weeks and r.weeks > 1:
        sessions += f" ({r.weeks} weeks)"
    return (
        f"| {r.profile}{mark} | {r.hw.devices} x {r.hw.memory_gib:.3g} | {s.data}x{s.fsdp}x{s.tp} | "
        f"{s.per_device_batch} x{s.grad_accum} | {size(r.peak)}{xla} | {fits} | {r.step_seconds:.3g} | "
        f"{r.samples_per_hour:,.0f} | {sessions} | {_hours(r.hours)} | {_money(r.cost)} | {_money(r.preemptible_cost)} | "
        f"{'; '.join(r.notes)} |"
    )


def _header(plan: Plan) -> list[str]:
    """The job, the selected hardware's verdict and the estimate's memory per device."""
    j, s = plan.job, plan.selected
    m = s.memory
    status = {"ok": "fits", "risky": "fits, with warnings", "over": "**does not fit**"}[plan.status]
    status = disk_status(plan, status)
    lines = [
        "# Plan",
        "",
        f"**{j.arch.name}** ({j.arch.model_type}, {j.arch.params / 1e6:,.1f}M parameters, "
        f"{m.trainable_params / 1e6:,.2f}M trained), {j.mode} fine-tuning in {j.param_dtype}"
        + (f" (compute {j.compute_dtype})" if j.compute_dtype else "")
        + f", {j.optimizer}, sequences of {j.seq_len} tokens, global batch {j.global_batch}, "
        f"{j.max_steps:,} steps ({j.samples:,} samples"
        + (f", {j.samples / j.train_rows:.1f} epochs" if j.train_rows else "")
        + f"), remat {j.remat}" + (f", loss chunks of {j.loss_chunk}" if j.loss_chunk else "") + ".",
        "",
        f"On **{s.profile}** ({s.hw.devices} x {s.hw.memory_gib:.3g} GiB, mesh data x fsdp x tp = "
        f"{s.setup.data}x{s.setup.fsdp}x{s.setup.tp}): {status} — {size(s.peak)} per device of "
        f"{size(s.usable_bytes)} usable"
        + (f" ({s.compiled_by}'s figure for the compiled step; the estimate says {size(m.peak)})" if s.compiled_peak is not None else "")
        + (f"; the process held {s.hw.process_gib:.2f} GiB of the host when planned, so it peaks at about "
           f"{process_peak_gib(s.hw, s.peak):.2f} GiB resident" if s.hw.process_gib else "")
        + f"; {_hours(s.hours)}, {_money(s.cost)}.",
        "",
        "| per device | estimate |",
        "|---|---:|",
        f"| parameters (a trained weight twice: input and update) | {size(m.params)} |",
        f"| gradients | {size(m.grads)} |",
        f"| optimizer state | {size(m.optimizer)} |",
        f"| activations kept for the backward pass | {size(m.activations)} |",
        f"| logits and output head | {size(m.logits)} |",
        f"| **peak** (the gradients overlap the activations) | **{size(m.peak)}** |",
        "",
    ]
    return lines


def precision_lines(p: dict | None) -> list[str]:
    """What share of the trained weights a step can change in their dtype (planning.precision)."""
    if not p:
        return []
    r, s = p["learning_rates"], p["share_changed"]
    dtype = p["param_dtype"] + (f", compute {p['compute_dtype']}" if p["compute_dtype"] else "")
    return [
        f"**Updates that land:** {p['trained']} kept in {dtype}, {p['optimizer']}: a step changes at most "
        f"**{s['peak']:.1%}** of them at the peak learning rate {r['peak']:.3g}, {s['end']:.1%} at the schedule's "
        f"end ({r['end']:.3g}), {s['smallest']:.1%} at its smallest nonzero rate ({r['smallest']:.3g}); an element "
        f"changes when the step reaches half its dtype's spacing at |w|. {p['step_model']}; {p['magnitudes']}.",
        "",
    ]


def _recommended(plan: Plan) -> str:
    if plan.recommended:
        r = plan.recommended
        return (
            f"**Recommended:** {r.profile} — the cheapest that fits and finishes within the budget: "
            f"{_hours(r.hours)}, {_money(r.cost)}"
            + (f" ({_money(r.preemptible_cost)} preemptible)" if r.preemptible_cost is not None else "")
            + (f", {r.sessions} session(s)" if r.steps_per_session is not None else "")
            + "."
        )
    return "**Recommended:** none of the profiles fits this run within the budget."


def markdown(plan: Plan) -> str:
    s = plan.selected
    lines = _header(plan) + goodput_lines(plan.goodput, s.profile, plan.job.padding) + ["", _recommended(plan), ""]
    lines += precision_lines(plan.job.precision)
    if plan.warnings:
        lines += ["**Warnings:**", ""] + [f"- {w}" for w in plan.warnings] + [""]
    if plan.advice:
        lines += ["**It would fit with any of:**", ""] + [f"- {a}" for a in plan.advice] + [""]
    if plan.headroom:
        lines += ["**The memory it leaves would hold any of (estimates):**", ""] + [f"- {h}" for h in plan.headroom] + [""]
    if plan.xla:
        lines += xla_section(plan.xla) + [""]
    planned = [stage for stage in POLISH if stage.name in plan.polish]  # the polish stages on, in the chain's order
    for stage in planned:
        lines += stage_planning(stage).markdown_section(plan) + [""]
    if planned:
        lines += stages_line(plan) + [""]
    if plan.disk:
        lines += disk_section(plan.disk) + [""]
    lines += scoring.markdown_lines(plan)
    lines += [
        "## Every hardware profile",
        "",
        "| hardware | devices x GiB | mesh | batch/device x accum | memory/device | fits (of usable) | step s | "
        "samples/h | sessions | time | cost | preemptible | notes |",
        "|---|---|---|---|---:|---|---:|---:|---|---:|---:|---:|---|",
    ]
    lines += [_row(r, s.profile, plan.recommended.profile if plan.recommended else None) for r in plan.rows]
    a = plan.assumptions
    flops = f"{s.compiled_by}'s FLOPs of the compiled step" if s.compiled_flops is not None else "FLOPs per step estimated from the shapes"
    lines += [
        "",
        f"Assumptions: MFU {s.mfu:g} on {s.profile} is **assumed**, not measured here "
        f"({s.hw.mfu_source or 'plan.mfu'}); every profile's MFU and its source are in "
        "conf/base/parameters_plan.yml. "
        f"{a.get('usable_memory_fraction'):.0%} of memory usable, "
        f"{a.get('checkpoint_seconds', 0):.0f} s per checkpoint, {a.get('session_setup_minutes'):g} min set-up per session. "
        f"Time = steps x FLOPs per step ({flops}) / (devices x peak x MFU) + checkpoints + set-up; "
        "cost = time x hourly price.",
        "",
    ]
    return "\n".join(lines)


def xla_section(x: dict) -> list[str]:
    lines = ["## Checked against XLA", ""]
    if x.get("out_of_memory"):
        return lines + [
            f"**XLA:TPU refuses the train step for {x['topology']}: it needs more than the chip's memory** "
            f"({x['error']}); the plan above counts at least {size(x['xla_gib'] * GIB)} per device."
        ]
    if x.get("does_not_compile"):
        return lines + [f"**The train step does not compile for {x['topology']}:** {x['error']}"]
    if x.get("error"):
        return lines + [f"Not checked: {x['error']}"]
    if x.get("compiler"):
        where = "no weights, no TPU needed" if x["platform"] == "tpu" else "no weights"
        return lines + [
            f"The run's own train step compiled by {x['compiler']} for {x['topology']} ({x['method']}; abstract shapes, "
            f"{where}) in {x['seconds']:.0f} s, mesh {x['mesh']}, {x['dtype']}: the plan above "
            "uses its memory and FLOPs.",
            "",
            f"| per device | estimate | {x['compiler']} | difference |",
            "|---|---:|---:|---:|",
            f"| peak memory (memory_analysis()) | {size(x['estimate_gib'] * GIB)} | {size(x['xla_gib'] * GIB)} | "
            f"{x['difference']:+.1%} |",
            f"| FLOPs per micro-batch step (cost_analysis()) | {x['flops_estimate_per_device'] / 1e12:,.2f} TFLOP | "
            f"{x['flops_per_device'] / 1e12:,.2f} TFLOP | "
            f"{x['flops_estimate_per_device'] / x['flops_per_device'] - 1:+.1%} |",
        ]
    lines += [
        f"The same train step compiled ahead of time ({x['method']}; abstract shapes, no weights) "
        f"on a fake {x['platform'].upper()} mesh {x['mesh']}, {x['dtype']}"
        + (f" ({x['dtype_note']})" if x.get("dtype_note") else "")
        + f", in {x['seconds']:.0f} s, beside the estimate for that program:",
        "",
        "| per device | estimate | XLA memory_analysis() | difference |",
        "|---|---:|---:|---:|",
        f"| peak | {size(x['estimate_gib'] * GIB)} | {size(x['xla_gib'] * GIB)} | {x['difference']:+.1%} |",
    ]
    if x.get("target", "cpu") != "cpu":
        lines += [
            "",
            "XLA:CPU keeps more than XLA:TPU/GPU (fewer fusions, float32 matmuls), so this program needs more "
            "memory than the accelerator run above: the estimate counts what an accelerator's compiler keeps.",
        ]
    return lines


def stages_line(plan: Plan) -> list[str]:
    st = plan.stages()
    parts = ", ".join(f"{name} {_hours(h) if h is not None else '?'}" for name, h in st["hours"].items())
    total = "unknown (a profile without a bandwidth)" if st["total_hours"] is None else (
        f"{_hours(st['total_hours'])}, {_money(st['total_cost'])}")
    return [f"**Every stage on {plan.selected.profile}:** {parts}; in all {total}."]


def disk_status(plan: Plan, status: str) -> str:
    """The header's verdict when the memory fits and the disk does not (the "Disk" section says why)."""
    if plan.status == "over" and plan.selected.fits and (plan.disk or {}).get("status") == "over":
        return "**does not fit its disk** (see Disk below); the memory fits"
    return status


def disk_refusal(plan: Plan) -> str:
    """A run whose memory fits and whose outputs do not fit the session's disk: by how much, and what to change."""
    lines = [f"{plan.job.arch.name}'s outputs do not fit the disk of {plan.selected.profile}:"]
    lines += [f"  - {m}" for m in plan.disk["messages"]]
    lines.append("  (`kedro run --pipelines=plan` shows every output's bytes; the profile's disk_gb is the volume)")
    return "\n".join(lines)


def disk_section(disk: dict) -> list[str]:
    """Every output's bytes on disk (planning.disk), per session, against the profile's volumes."""
    v = disk["volumes"]
    limits = [f"the session's disk {v['disk_gb']:g} GB" if v["disk_gb"] else "the disk: not known",
              f"saved output {v['saved_output_gb']:g} GB" if v["saved_output_gb"] else "no saved-output limit"]
    verdict = {"ok": "fits", "warning": "fits the disk, **not the saved output**", "over": "**does not fit the disk**"}
    lines = ["## Disk", "",
             f"Output root `{v['output_root']}`; {', '.join(limits)}" + (f" ({v['source']})" if v["source"] else "")
             + (". Each session starts on an empty output root: the largest session counts." if v["fresh_root_each_session"]
                else ". The sessions' outputs add up on the same disk.") + f" Verdict: {verdict[disk['status']]}.", "",
             "| session | output | where | kept | each | weights | optimizer | GB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for s in disk["sessions"]:
        for o in s["outputs"]:
            p = o["parts_gb"]
            lines.append(f"| {s['name']} | {o['what']} | {o['where']}: `{o['path']}` | {o['count']} | {o['gb_each']:.3f} | "
                         f"{p['weights']:.3f} | {p['optimizer']:.3f} | {o['gb']:.3f} |" if "optimizer" in p else
                         f"| {s['name']} | {o['what']} | {o['where']}: `{o['path']}` | {o['count']} | {o['gb_each']:.3f} | "
                         f"| | {o['gb']:.3f} |")
        lines.append(f"| {s['name']} | **saved output** / **session disk (peak)** | | | | | | "
                     f"**{s['saved_gb']:.2f}** / **{s['disk_peak_gb']:.2f}** |")
    return lines


def refusal(plan: Plan) -> str:
    """Why the selected run cannot start, by how much, and what would make it fit."""
    if plan.selected.fits and (plan.disk or {}).get("status") == "over":
        return disk_refusal(plan)
    s = plan.selected
    over = s.peak - s.usable_bytes
    m = s.memory
    compiled = ""
    if s.compiled_peak is not None and plan.xla:
        compiled = (f" at least (XLA:TPU refuses to compile it for {plan.xla['topology']})" if plan.xla.get("out_of_memory")
                    else f" ({s.compiled_by}, compiled for {plan.xla['topology']})")
    lines = [
        f"{plan.job.arch.name} ({plan.job.mode} fine-tuning, {plan.job.param_dtype}, per-device batch "
        f"{s.setup.per_device_batch} x {plan.job.seq_len} tokens, mesh {s.setup.mesh}) does not fit {s.profile}: "
        f"it needs {size(s.peak)} per device{compiled} and {size(s.usable_bytes)} is usable "
        f"({s.hw.memory_gib:g} GiB x {plan.assumptions.get('usable_memory_fraction', 1):g}): "
        f"over by {size(over)} ({over / s.usable_bytes:.0%}).",
        f"  per device (estimate, {size(m.peak)} in all): parameters {size(m.params)}, gradients {size(m.grads)}, optimizer {size(m.optimizer)}, "
        f"activations {size(m.activations)}, logits {size(m.logits)}.",
    ]
    if plan.advice:
        lines.append("  It would fit with any of:")
        lines += [f"  - {a}" for a in plan.advice]
    else:
        lines.append("  Nothing tried here makes it fit: use LoRA/QLoRA with a smaller batch, remat and shorter sequences, or a larger machine.")
    lines.append("  (`kedro run --pipelines=plan` shows every hardware profile; `plan.enabled: false` skips this check.)")
    return "\n".join(lines)
