"""GRPO in the plan: memory per device and time of its two phases, generation and the policy update.

A step of Tunix's GRPOLearner (our `train/grpo.py`, vanilla rollout, the actor's mesh for every role):

1. **generation**: `batch_size` prompts x `num_generations` completions, prefilled and then
   decoded one token at a time for up to `max_completion_length` tokens (our `upstream.Sampler`: a KV
   cache of sequences x (prompt + completion) positions, keys and values per layer, in the model's
   dtype; the model's activation sharding splits the sequences over fsdp; the prefill's logits at the
   last position only). The trainer's state stays in memory meanwhile: the policy, its optimizer state
   and the reference.
   Time: the prefill's FLOPs at the profile's MFU, then `max_completion_length` decode steps, each
   its **roofline** (per device, the larger of FLOPs / peak and bytes / HBM bandwidth) over the
   profile's `decode_roofline_fraction`, the share of the roofline our sampler reaches (measured or
   assumed: its `decode_source`). The roofline's FLOPs and bytes are XLA:TPU's cost analysis of the
   compiled decode step when `grpo_xla` compiled it, else the estimate's: every weight (the fsdp
   all-gather brings each chip the whole layer) and the cache half full, and 2 FLOPs a weight and sequence.
2. **update**: the reference model's log-probabilities (`beta > 0`, one forward pass) and, with
   `num_iterations > 1`, the old policy's, then `num_iterations` optimizer steps: SFT's train step
   shape at batch x G sequences of prompt + completion tokens, without loss chunks (Tunix's GRPO
   loss takes the whole logits); with `micro_batch_size`, micro x G sequences at a time, their gradients
   accumulated (train/grpo.py's Tunix micro-batches: the log-probabilities and the gradient; the rollout still
   decodes the whole batch at once).
3. **the prompt filter** (`grpo.prompt_filter`, once before the first step): the pool's prompts x `samples`
   completions, each timed as a rollout's, at its whole `max_completion_length` (rows that end sooner make it less:
   on this CPU 84 minutes against the 3.2 hours planned; benchmarks/RESULTS.md, section 39); the pool is
   `max_prompts`, at most the training rows where the plan knows them (unknown without either: no time for it).
   Memory: the rollouts' decode program with its KV cache and a step's logits resized to the screen's
   `batch_size` rows and the evaluation sampler's cache (prompt + twice the new tokens: `Generator`), and the
   prefill's hidden states over its prompts; no optimizer state or reference yet (the trainer is built after it).

The reference (`loop.frozen_copy`) shares the actor's arrays until the actor changes them: a
whole copy of the weights with full fine-tuning, only the adapters with LoRA.
`planning.grpo_xla` compiles both phases for a TPU topology, or for this CPU when the run is planned on it; the plan
then uses those figures.
"""

from __future__ import annotations

import dataclasses
import math

from tunix_pipeline.config import GrpoParams, ModelParams, PlanParams, RuntimeParams
from tunix_pipeline.models.architecture import Architecture
from tunix_pipeline.planning import grpo_xla, judge
from tunix_pipeline.planning.decode import decode_line, decode_step, kv_cache_bytes
from tunix_pipeline.planning.grpo_shapes import decode_program_bytes, rollout_setup, update_setup
from tunix_pipeline.planning.memory import GIB, TrainSetup, estimate_memory, reference_bytes
from tunix_pipeline.planning.plan import Plan, Row, process_peak_gib, size
from tunix_pipeline.planning.polish import PlannedStage
from tunix_pipeline.planning.scoring import generation_bytes
from tunix_pipeline.stages import GRPO


def _batch_seconds(arch: Architecture, hw, setup: TrainSetup, grpo: GrpoParams, mfu: float, step: dict,
                   compiled_flops: float | None) -> tuple:
    """(prefill, decode or None without a decode step time, reference/old log-probabilities, updates: seconds;
    the update's FLOPs): one batch of rollouts and its num_iterations updates."""
    prompt, completion = grpo.max_prompt_length, grpo.max_completion_length
    length = prompt + completion
    sequences = grpo.batch_size * grpo.num_generations
    rate = hw.devices * hw.peak_tflops * 1e12 * mfu
    prefill_seconds = 2 * arch.params * sequences * prompt / rate
    decode_seconds = None if step["seconds"] is None else completion * step["seconds"]
    forward_passes = (1 if grpo.beta else 0) + (1 if grpo.num_iterations > 1 else 0)  # reference, old policy
    logps_seconds = forward_passes * 2 * arch.params * sequences * length / rate
    mode = "full" if setup.mode == "full" else "lora"
    update_flops = sequences * length * arch.train_flops_per_token(length, mode, setup.remat)
    if compiled_flops:  # one micro-batch's program
        update_flops = compiled_flops * setup.devices * setup.grad_accum
    update_seconds = grpo.num_iterations * update_flops / rate
    return prefill_seconds, decode_seconds, logps_seconds, update_seconds, update_flops


def stage_row(plan: Plan, row: Row, grpo: GrpoParams, params: PlanParams, session_hours: float | None = None,
              compiled: dict | None = None, judges: dict | None = None) -> dict:
    """GRPO on one profile (the SFT row's mesh and dtypes; with a judge on its own devices, the policy's row on the
    others: `judge.policy_row`); `compiled`: `grpo_xla.check`'s figures for it; `judges`: `judge.terms` on it."""
    arch, hw, setup, roll = plan.job.arch, row.hw, update_setup(row, grpo), rollout_setup(row, grpo)
    prompt, length, seqs = grpo.max_prompt_length, grpo.max_prompt_length + grpo.max_completion_length, roll.per_device_batch
    m = estimate_memory(arch, setup)
    reference = reference_bytes(arch, setup, m.trainable_params) if grpo.beta else 0.0
    shared = judges["shared"] if judges else 0.0  # time-shared judges' weights, beside both phases
    # generation: the decode step's program (the policy once: the update's input and output copies are not
    # live), the prefill's float32 hidden states over the prompt on top (our sampler's prefill takes the logits at
    # the last position only, as a decode step does: `upstream.Sampler`), and beside them the optimizer state and
    # the reference
    kv = kv_cache_bytes(arch, roll, seqs, length)
    decode = decode_program_bytes(arch, roll, seqs)
    prefill_hidden = seqs * prompt * arch.hidden_size * 4
    update = m.peak + reference + shared
    gen_x, upd_x = (compiled or {}).get("generation") or {}, (compiled or {}).get("update") or {}
    compiler = (compiled or {}).get("compiler", "XLA:TPU")
    if "xla_gib" in gen_x:
        decode = gen_x["xla_gib"] * GIB
    generation = decode + prefill_hidden + m.optimizer + reference + shared
    if "xla_gib" in upd_x:  # the train step holds the policy and its optimizer; the reference beside it
        update = upd_x["xla_gib"] * GIB + reference + shared
    screen = _screen_bytes(arch, roll, grpo, seqs) + decode + shared if grpo.prompt_filter is not None else 0.0

    mfu = hw.mfu or params.mfu
    # the CPU's decode_roofline_fraction is measured against the estimate's roofline, and XLA:CPU's bytes accessed
    # count its copies of the cache (benchmarks/RESULTS.md, section 25): its decode time stays the estimate's
    step_x = decode_step(arch, hw, roll, grpo.max_prompt_length, grpo.max_completion_length,
                         gen_x if compiler == "XLA:TPU" else None)
    prefill_seconds, decode_seconds, logps_seconds, update_seconds, update_flops = _batch_seconds(
        arch, hw, setup, grpo, mfu, step_x, upd_x.get("flops_per_device"))
    out = {
        "session_hours": min((h for h in (session_hours, hw.session_hours) if h), default=None),
        "sequences_per_device": seqs,
        "update_sequences_per_device": setup.per_device_batch,
        "micro_batches": setup.grad_accum,
        "sequence_length": length,
        "generation_gib": round(generation / GIB, 3),
        "generation_from": compiler if "xla_gib" in gen_x else "estimate",
        "update_gib": round(update / GIB, 3),
        "update_from": compiler if "xla_gib" in upd_x else "estimate",
        "kv_cache_gib": round(kv / GIB, 3),
        "reference_gib": round(reference / GIB, 3),
        "usable_memory_gib": round(row.usable_bytes / GIB, 3),
        "fits": max(generation, update, screen) <= row.usable_bytes,
        "process_peak_gib": process_peak_gib(hw, max(generation, update, screen)),
        "decode_step": step_x,
        "mfu": mfu,
        "generation_seconds": None if decode_seconds is None else prefill_seconds + decode_seconds,
        "update_seconds": logps_seconds + update_seconds,
        "update_flops": update_flops,
        "update_flops_from": compiler if upd_x.get("flops_per_device") else "estimate",
        "rollout_batches": math.ceil(grpo.max_steps / grpo.num_iterations),
        "quoted_estimate": hw.quoted_grpo_estimate or None,
        "step_seconds": None, "samples_per_hour": None, "hours": None, "within_session": None, "cost": None,
    }
    if grpo.prompt_filter is not None:  # its time below, where the plan has the rollouts'
        out["prompt_filter"] = {"gib": round(screen / GIB, 3), "completions": None, "seconds": None}
    if judges:
        # time-shared scoring: the policy's resident state (weights once, optimizer state, reference) and the call
        scoring = (m.params - m.grads + m.optimizer + reference + judges["shared_peak"]) if judges["shared"] else None
        out["judge"] = {**judges["summary"], "shared_scoring_gib": None if scoring is None else round(scoring / GIB, 3)}
    judge_seconds = judges["seconds"] if judges else 0.0
    if decode_seconds is None or judge_seconds is None:  # no bandwidth or no roofline fraction: no time
        return out
    if grpo.prompt_filter is not None:
        pool = min((n for n in (grpo.max_prompts, plan.job.train_rows) if n), default=None)
        completions = pool and pool * grpo.prompt_filter.samples
        per_completion = (prefill_seconds + decode_seconds) / (grpo.batch_size * grpo.num_generations)
        seconds = completions and completions * per_completion
        out["prompt_filter"].update(completions=completions, seconds=seconds)
    _timed(out, prefill_seconds + decode_seconds + logps_seconds + update_seconds + judge_seconds, grpo, row, params)
    return out


def _screen_bytes(arch: Architecture, roll: TrainSetup, grpo: GrpoParams, rollout_sequences: int) -> float:
    """What the prompt filter's screen holds beyond the rollouts' decode program, per device (negative where it holds
    less): the evaluation sampler's generation at its rows (`scoring.generation_bytes`) in place of the rollouts'
    cache and a step's logits."""
    prompt, completion = grpo.max_prompt_length, grpo.max_completion_length
    return (generation_bytes(arch, roll, grpo.prompt_filter.batch_size, prompt, completion)
            - kv_cache_bytes(arch, roll, rollout_sequences, prompt + completion)
            - rollout_sequences * arch.vocab_size * 4)


def _timed(out: dict, step: float, grpo: GrpoParams, row: Row, params: PlanParams) -> None:
    """`out`'s step time, completions an hour, hours (checkpoints and set-up included), session fit and cost."""
    hw = row.hw
    setup_hours = (hw.setup_minutes if hw.setup_minutes is not None else params.session_setup_minutes) / 60
    saves = math.ceil(grpo.max_steps / grpo.checkpoint_every)
    screen = (out.get("prompt_filter") or {}).get("seconds") or 0.0
    hours = (screen + out["rollout_batches"] * step + saves * row.checkpoint_seconds) / 3600 + setup_hours
    out.update(
        step_seconds=step,
        samples_per_hour=grpo.batch_size * grpo.num_generations * 3600 / step,
        hours=hours,
        within_session=out["session_hours"] is None or hours <= out["session_hours"],
        cost=hours * hw.cost_per_hour if hw.cost_per_hour is not None else None,
    )


def loaded_in(plan: Plan, dtype: str) -> Plan:
    """`plan` as GRPO sees it: the model loaded in `dtype` (its session's model.dtype) and computing in it (GRPO
    takes no sft.compute_dtype), on every profile; the warnings a copy, for `add_grpo` to extend."""
    rows = [dataclasses.replace(r, setup=r.setup.replace(param_dtype=dtype, compute_dtype=None)) for r in plan.rows]
    selected = rows[plan.rows.index(plan.selected)]
    return dataclasses.replace(plan, rows=rows, selected=selected, warnings=list(plan.warnings), polish=dict(plan.polish))


def add_grpo(plan: Plan, grpo: GrpoParams, params: PlanParams, session_hours: float | None = None,
             compiled: dict | None = None) -> Plan:
    """GRPO's figures on every profile, in `plan.polish[GRPO.name]`; a warning when a phase does not fit or the session
    is short, a `PlanError` when a judge's layout cannot run on the selected profile. `compiled`: XLA:TPU's figures for the
    selected profile (`grpo_xla.check`)."""
    if not grpo.enabled:
        return plan
    arches = judge.architectures(grpo, params)
    rows = {r.profile: _profile(plan, r, grpo, params, session_hours,
                                compiled if r.profile == plan.selected.profile else None, arches) for r in plan.rows}
    selected = rows[plan.selected.profile]
    if arches and judge.refusal(selected, plan.selected.profile):  # fails the plan, saying what would run
        raise judge.refusal(selected, plan.selected.profile)
    plan.polish[GRPO.name] = {
        "loss_variant": grpo.loss_variant,
        "reference": "none" if not grpo.beta else "adapters" if plan.job.mode != "full" else "model",
        "steps": grpo.max_steps,
        "completions_per_step": grpo.batch_size * grpo.num_generations,
        "selected": {"hardware": plan.selected.profile, **selected},
        "profiles": rows,
        "xla_check": compiled,
    }
    hw, warned = plan.selected.profile, len(plan.warnings)
    if not selected["fits"]:
        plan.warnings.append(_over(selected, hw))
    elif selected["within_session"] is False:
        plan.warnings.append(
            f"GRPO's {grpo.max_steps} steps take {selected['hours']:.1f} h on {hw}, over its "
            f"{selected['session_hours']:g} h session: lower grpo.max_steps, or split them over sessions"
        )
    if len(plan.warnings) > warned and plan.status == "ok":  # GRPO's own warnings (the padding one is about time)
        plan.status = "risky"
    return plan


def _over(s: dict, hw: str) -> str:
    """GRPO's larger phase on `hw` (`s`: its row) against the usable memory, and what lowers it."""
    phases = {
        "generation": (s["generation_gib"], s["generation_from"],
                       "lower grpo.batch_size, num_generations or max_completion_length"),
        "update": (s["update_gib"], s["update_from"],
                   "lower grpo.micro_batch_size (the update a few prompts at a time) or max_completion_length"),
        "prompt filter's screen": ((s.get("prompt_filter") or {}).get("gib", 0.0), s["generation_from"],
                                   "lower grpo.prompt_filter.batch_size or max_completion_length"),
    }
    phase, (gib, source, fix) = max(phases.items(), key=lambda item: item[1][0])  # the first of equals
    return f"GRPO's {phase} needs {gib:.2f} GiB per device on {hw} ({source}; of {s['usable_memory_gib']:.2f} usable): {fix}"


def refusal(plan: Plan) -> str:
    """Why this session's GRPO stage cannot fit the selected profile: the sft preflight's stop, before any training."""
    return f"{_over(plan.polish[GRPO.name]['selected'], plan.selected.profile)}; stopped before SFT, nothing trained"


def _profile(plan: Plan, row: Row, grpo: GrpoParams, params: PlanParams, session_hours: float | None,
             compiled: dict | None, arches: dict) -> dict:
    """GRPO on one profile, with its judges (`arches`: their architectures) where it has some."""
    if not arches:
        return stage_row(plan, row, grpo, params, session_hours, compiled)
    policy, problem = judge.policy_row(plan, row, grpo, params)
    terms = judge.terms(plan, row, policy, grpo, params, arches, (compiled or {}).get("judges"), problem)
    out = stage_row(plan, policy, grpo, params, session_hours, compiled, terms)
    out["fits"] = out["fits"] and judge.refusal(out, row.profile) is None
    return out


def _time(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.3g}"


def add_stage(plan: Plan, planned: PlannedStage, model: ModelParams, params: PlanParams,
              runtime: RuntimeParams) -> Plan:
    """The plan's step for GRPO: the model loaded as its session loads it, XLA:TPU's compiled phases where libtpu or
    a TPU is at hand; the figures go into `plan` (its polish, warnings and status)."""
    grpo = planned.params
    grpo_model = model.changed(planned.session_changes.get("model"))
    policy = loaded_in(plan, grpo_model.dtype)
    compiled = None
    if params.xla_check.enabled and params.xla_check.grpo and grpo.enabled:
        compiled = grpo_xla.check(policy, grpo_model, grpo, params.xla_check.max_layers, params, runtime.decode_weights)
    policy = add_grpo(policy, grpo, params, planned.session_hours, compiled)
    plan.polish, plan.warnings, plan.status = policy.polish, policy.warnings, policy.status
    return plan


def markdown_section(plan: Plan) -> list[str]:
    g = plan.polish[GRPO.name]
    s = g["selected"]
    fits = "fits" if s["fits"] else "**does not fit**"
    micro = (f"; the update {s['update_sequences_per_device']} at a time, {s['micro_batches']} micro-batches"
             if s["micro_batches"] > 1 else "")
    lines = [
        f"## GRPO ({g['loss_variant']}, {g['completions_per_step']} completions a step, reference {g['reference']})",
        "",
        f"On **{s['hardware']}**, {s['sequences_per_device']} sequences of {s['sequence_length']} tokens per device "
        f"decoded together{micro} ({fits} the {size(s['usable_memory_gib'] * GIB)} usable):",
        "",
        "| phase | memory/device | from | time per step |",
        "|---|---:|---|---:|",
        f"| generation (KV cache {size(s['kv_cache_gib'] * GIB)}) | {size(s['generation_gib'] * GIB)} | "
        f"{s['generation_from']} | {_time(s['generation_seconds'])} s |",
        f"| update (reference {size(s['reference_gib'] * GIB)}) | {size(s['update_gib'] * GIB)} | "
        f"{s['update_from']} | {_time(s['update_seconds'])} s |",
        *([(f"| the prompt filter's screen, before the first step | {size(s['prompt_filter']['gib'] * GIB)} | "
            f"{s['generation_from']}, resized | once |")] if s.get("prompt_filter") else []),
        "",
    ]
    if "judge" in s:
        lines += judge.markdown_lines(s)
    if s["hours"] is not None:
        hw = plan.selected.hw
        lines += [f"{g['steps']} steps ({s['rollout_batches']} batches of rollouts), {s['samples_per_hour']:,.0f} "
                  f"completions an hour: {s['hours']:.3g} h with set-up"
                  + (f", within the {s['session_hours']:g} h session" if s["within_session"] and s["session_hours"]
                     else f", **over** the {s['session_hours']:g} h session" if s["session_hours"] else "")
                  + "." + _filter_sentence(s.get("prompt_filter")), "",
                  decode_line(s["decode_step"]) + f" The update at MFU {s['mfu']:g}, **assumed** "
                  f"({hw.mfu_source or 'plan.mfu'}).", ""]
        if s["quoted_estimate"]:
            lines += [f"**GRPO completions an hour on {s['hardware']}:** this plan {s['samples_per_hour']:,.0f} "
                      f"({g['steps'] * g['completions_per_step']:,} in {s['hours']:.3g} h); "
                      f"{s['quoted_estimate']}.", ""]
    x = g.get("xla_check") or {}
    if x:
        lines += xla_lines(x) + [""]
    lines += [
        "| hardware | generation/device | update/device | fits | step s | completions/h | hours | cost |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in g["profiles"].items():
        cost = "—" if r["cost"] is None else f"${r['cost']:,.2f}"
        per_hour = "—" if r["samples_per_hour"] is None else f"{r['samples_per_hour']:,.0f}"
        lines.append(f"| {name} | {size(r['generation_gib'] * GIB)} | {size(r['update_gib'] * GIB)} | "
                     f"{'yes' if r['fits'] else 'no'} | {_time(r['step_seconds'])} | {per_hour} | "
                     f"{_time(r['hours'])} | {cost} |")
    return lines


def _filter_sentence(screen: dict | None) -> str:
    if screen is None:
        return ""
    if screen["seconds"] is None:
        return " The prompt filter's screen is not in it: set grpo.max_prompts (or plan.train_rows) to time it."
    return (f" The prompt filter's screen first, {screen['completions']:,} completions at their whole length: "
            f"{screen['seconds'] / 3600:.2g} h of them.")


def xla_lines(x: dict) -> list[str]:
    out, compiler = [], x.get("compiler", "XLA:TPU")
    for phase, what in (("generation", "one decode step with the KV cache"),
                        ("update", "the policy update (GRPO loss on the reference's log-probabilities)")):
        r = x.get(phase) or {}
        if r.get("out_of_memory"):
            out.append(f"- {phase}: **{compiler} refuses {what} for {x['topology']}: it needs more than the chip's "
                       f"memory** ({r['error']})")
        elif "xla_gib" in r:
            out.append(f"- {phase}: {what} compiled by {compiler} for {x['topology']} ({r['method']}) in "
                       f"{r['seconds']:.0f} s: {size(r['xla_gib'] * GIB)} per chip, "
                       f"{r['flops_per_device'] / 1e12:,.3g} TFLOP"
                       + (f" and {r['bytes_accessed_per_device'] / 1e9:,.3g} GB accessed"
                          if r.get("bytes_accessed_per_device") else "")
                       + " per chip; the estimate of that program: "
                       f"{size(r['estimate_gib'] * GIB)} ({r['difference']:+.0%})")
        elif r.get("does_not_compile"):
            out.append(f"- {phase}: **does not compile for {x['topology']} ({compiler}):** {r['error']}")
        elif r.get("error"):
            out.append(f"- {phase}: not compiled: {r['error']}")
    return [f"Checked against {compiler} (abstract shapes, no weights, no TPU needed):", ""] + out if out else []
