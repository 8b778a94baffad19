"""The preference stage (DPO / ORPO / SimPO) in the plan: memory per device, time and cost, pair building included.

Its train step is SFT's step shape with twice the rows (each pair's chosen and rejected
answers, one forward and backward pass together) of prompt + answer tokens, so its memory is
`estimate_memory` of that shape, plus DPO's reference model: a whole frozen copy of the
weights with full fine-tuning, only the SFT adapters with LoRA (the reference shares the base
arrays), nothing with `precompute_reference` (one forward pass over the pairs first instead).
Time: the step's FLOPs (and the reference's forward pass, 2 FLOPs per parameter and token) at
the plan's MFU; building pairs from rewards is generation, at `plan.generation_mfu` (decoding
reads every weight for each token of a batch, so it runs far below training's MFU).
"""

from __future__ import annotations

import dataclasses

from tunix_pipeline.config import DEFAULT_LOSS_CHUNK, ModelParams, PlanParams, PreferenceParams, RuntimeParams
from tunix_pipeline.planning import memory
from tunix_pipeline.planning.memory import GIB, estimate_memory
from tunix_pipeline.planning.plan import Plan, Row, size
from tunix_pipeline.planning.polish import PlannedStage
from tunix_pipeline.planning.xla_check import check_against_xla as sft_check
from tunix_pipeline.stages import PREFERENCE


def reference_bytes(plan: Plan, row: Row, pref: PreferenceParams) -> float:
    """Per device: what DPO's reference model adds (0 for ORPO, SimPO, or precomputed log-probabilities)."""
    if pref.method != "dpo" or pref.precompute_reference:
        return 0.0
    return memory.reference_bytes(plan.job.arch, row.setup, row.memory.trainable_params)


def stage_setup(row: Row, pref: PreferenceParams):
    """The policy's train step on this profile: chosen and rejected rows of prompt + answer tokens."""
    seq = pref.max_prompt_length + pref.max_response_length
    return row.setup.replace(per_device_batch=2 * pref.per_device_batch_size, seq_len=seq, grad_accum=1,
                             loss_chunk=DEFAULT_LOSS_CHUNK, optimizer=pref.optimizer, mu_dtype=pref.mu_dtype)


def check_against_xla(plan: Plan, model, max_layers: int | None, timeout: float) -> dict:
    """XLA's peak for the policy's step of the selected profile (SFT's step compiled at the stage's shape;
    the reference's weights come on top of both figures)."""
    setup = stage_setup(plan.selected, plan.polish[PREFERENCE.name]["params"])
    return sft_check(dataclasses.replace(plan, selected=dataclasses.replace(plan.selected, setup=setup)), model,
                     max_layers, timeout)


def stage_row(plan: Plan, row: Row, pref: PreferenceParams, params: PlanParams) -> dict:
    """The preference stage on one profile (the SFT row's mesh and dtypes)."""
    arch, hw = plan.job.arch, row.hw
    seq = pref.max_prompt_length + pref.max_response_length
    setup = stage_setup(row, pref)
    memory = estimate_memory(arch, setup)
    reference = reference_bytes(plan, row, pref)
    peak = memory.peak + reference
    usable = row.usable_bytes
    pairs_per_step = pref.per_device_batch_size * setup.data * setup.fsdp
    mode = "full" if setup.mode == "full" else "lora"
    flops = 2 * pairs_per_step * seq * arch.train_flops_per_token(seq, mode, setup.remat)
    if reference or (pref.method == "dpo" and pref.precompute_reference):
        flops += 2 * pairs_per_step * seq * 2 * arch.params  # the reference's forward pass (once, when precomputed)
    mfu = hw.mfu or params.mfu
    step_seconds = flops / (hw.devices * hw.peak_tflops * 1e12 * mfu)
    pair_seconds = 0.0
    samples = 0
    if pref.pairs == "from_rewards":
        spec = pref.from_rewards
        samples = (spec.max_prompts + spec.eval_prompts) * spec.num_samples
        tokens = samples * (pref.max_prompt_length + spec.max_new_tokens)
        pair_seconds = 2 * arch.params * tokens / (hw.devices * hw.peak_tflops * 1e12 * params.generation_mfu)
    hours = (pref.max_steps * step_seconds + pair_seconds) / 3600
    session = min((h for h in (pref.time_budget_hours, hw.session_hours) if h), default=None)
    return {
        "session_hours": session,
        "within_session": session is None or hours <= session,
        "fits": peak <= usable,
        "memory_per_device_gib": round(peak / GIB, 3),
        "reference_gib": round(reference / GIB, 3),
        "usable_memory_gib": round(usable / GIB, 3),
        "sequences_per_device": setup.per_device_batch,
        "sequence_length": seq,
        "step_seconds": step_seconds,
        "pair_building_samples": samples,
        "pair_building_hours": pair_seconds / 3600,
        "hours": hours,
        "cost": hours * hw.cost_per_hour if hw.cost_per_hour is not None else None,
    }


def add_preference(plan: Plan, pref: PreferenceParams, params: PlanParams) -> Plan:
    """The preference stage's figures on every profile, in `plan.polish[PREFERENCE.name]`; a warning when it does not
    fit."""
    if not pref.enabled:
        return plan
    rows = {r.profile: stage_row(plan, r, pref, params) for r in plan.rows}
    selected = rows[plan.selected.profile]
    plan.polish[PREFERENCE.name] = {
        "method": pref.method,
        "pairs": pref.pairs,
        "reference": "model" if pref.method == "dpo" and not pref.precompute_reference
        else "precomputed" if pref.method == "dpo" else "none",
        "steps": pref.max_steps,
        "selected": {"hardware": plan.selected.profile, **selected},
        "profiles": rows,
        "params": pref,  # for the XLA check; not in the summary
    }
    if not selected["fits"]:
        plan.warnings.append(
            f"the {pref.method} stage needs {selected['memory_per_device_gib']:.2f} GiB per device on "
            f"{plan.selected.profile} (of {selected['usable_memory_gib']:.2f} usable): lower "
            "preference.per_device_batch_size or max_response_length"
            + (", or set precompute_reference: true" if selected["reference_gib"] else "")
        )
        if plan.status == "ok":
            plan.status = "risky"
    return plan


def add_stage(plan: Plan, planned: PlannedStage, model: ModelParams, params: PlanParams,
              runtime: RuntimeParams) -> Plan:
    """The plan's step for this stage: its figures within its session's hours, checked against XLA where the plan is."""
    pref = planned.params
    if planned.session_hours:
        pref = pref.model_copy(update={"time_budget_hours": planned.session_hours})
    plan = add_preference(plan, pref, params)
    if params.xla_check.enabled and PREFERENCE.name in plan.polish:
        plan.polish[PREFERENCE.name]["xla_check"] = check_against_xla(plan, model, params.xla_check.max_layers,
                                                                      params.xla_check.timeout_seconds)
    return plan


def markdown_section(plan: Plan) -> list[str]:
    p = plan.polish[PREFERENCE.name]
    s = p["selected"]
    lines = [
        f"## Preference stage ({p['method']}, pairs {p['pairs'].replace('_', ' ')}, reference {p['reference']})",
        "",
        f"On **{s['hardware']}**: {size(s['memory_per_device_gib'] * GIB)} per device of "
        f"{size(s['usable_memory_gib'] * GIB)} usable ({'fits' if s['fits'] else '**does not fit**'}; reference "
        f"{size(s['reference_gib'] * GIB)}), "
        f"{s['sequences_per_device']} sequences of {s['sequence_length']} tokens per device, {p['steps']} steps "
        f"of {s['step_seconds']:.2f} s, pair building {s['pair_building_samples']} samples in "
        f"{s['pair_building_hours']:.3g} h; {s['hours']:.3g} h in all.",
        "",
    ]
    if p.get("xla_check"):
        x = p["xla_check"]
        where = f"by {x['compiler']} for {x['topology']}" if x.get("compiler") else "on a fake CPU mesh"
        lines += [f"Checked against XLA (the policy's step compiled {where}, {x.get('dtype')}, without "
                  "the reference): " + (f"XLA {size(x['xla_gib'] * GIB)}, estimate {size(x['estimate_gib'] * GIB)} "
                                        f"({x['difference']:+.0%})." if "xla_gib" in x
                                        else f"not compiled: {x.get('error')}"), ""]
    lines += [
        "| hardware | memory/device | fits | step s | pair building h | hours | cost |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in p["profiles"].items():
        cost = "—" if r["cost"] is None else f"${r['cost']:,.2f}"
        lines.append(f"| {name} | {size(r['memory_per_device_gib'] * GIB)} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['step_seconds']:.3g} | {r['pair_building_hours']:.3g} | {r['hours']:.3g} | {cost} |")
    return lines
