"""GRPO in the plan: memory per device and time of its two phases, generation and the policy update.

A step of Tunix's GRPOLearner (our `grpo.py`, vanilla rollout, the actor's mesh for every role):

1. **generation**: `batch_size` prompts x `num_generations` completions, prefilled and then
   decoded one token at a time for up to `max_completion_length` tokens (Tunix's `Sampler`: a KV
   cache of sequences x (prompt + completion) positions, keys and values per layer, in the model's
   dtype; the model's activation sharding splits the sequences over fsdp). The trainer's state
   stays in memory meanwhile: the policy, its optimizer state and the reference.
   Time: the prefill's FLOPs at the profile's MFU, then each decode step reads every weight (the
   fsdp all-gather brings each chip the whole layer) and the cache so far, at the profile's HBM
   bandwidth x `decode_utilisation` (decoding a few sequences is bound by memory, not FLOPs).
2. **update**: the reference model's log-probabilities (`beta > 0`, one forward pass) and, with
   `num_iterations > 1`, the old policy's, then `num_iterations` optimizer steps: SFT's train step
   shape at batch x G sequences of prompt + completion tokens, without loss chunks (Tunix's GRPO
   loss takes the whole logits), no micro-batching (grpo.py leaves Tunix's at the whole batch).

The reference (`grpo.frozen_copy`) shares the actor's arrays until the actor changes them: a
whole copy of the weights with full fine-tuning, only the adapters with LoRA.
`planning.grpo_xla` compiles both phases for a TPU topology; the plan then uses those figures.
"""

from __future__ import annotations

import math

from tunix_pipeline.config import GrpoParams, PlanParams
from tunix_pipeline.planning.architecture import Architecture
from tunix_pipeline.planning.memory import GIB, NF4_BYTES, TrainSetup, estimate_memory, reference_bytes
from tunix_pipeline.planning.plan import Plan, Row, size


def sequences_per_device(grpo: GrpoParams, setup: TrainSetup) -> int:
    """Completions a device holds: batch x G split over the data-parallel devices (whole when it does not divide)."""
    sequences = grpo.batch_size * grpo.num_generations
    dp = setup.data * setup.fsdp
    return sequences // dp if sequences % dp == 0 else sequences


def update_setup(row: Row, grpo: GrpoParams) -> TrainSetup:
    """The policy's train step on this profile: batch x G sequences of prompt + completion tokens."""
    return row.setup.replace(per_device_batch=sequences_per_device(grpo, row.setup),
                             seq_len=grpo.max_prompt_length + grpo.max_completion_length, grad_accum=1, loss_chunk=None)


def kv_cache_bytes(arch: Architecture, setup: TrainSetup, sequences: int, positions: int) -> float:
    """Per device: keys and values of `sequences` x `positions` in every layer (Tunix's cache: one size for all
    layers, sliding-window ones included), kv heads split over tp where they divide."""
    tp = setup.tp if arch.num_kv_heads % setup.tp == 0 else 1
    return arch.num_layers * 2 * sequences * positions * arch.num_kv_heads * arch.head_dim * setup.c_bytes / tp


def decode_program_bytes(arch: Architecture, setup: TrainSetup, sequences: int) -> float:
    """Per device: what one decode step holds: the policy (once), every weight all-gathered, the KV cache and a
    step's float32 logits. The gathered weights are the conservative case: XLA:TPU gathers the whole fsdp-sharded
    model for Gemma-2-2B's decode step on a v5e 2x4 (0.17 GiB more a layer; -21% at 3 layers), but not for
    Gemma-3-1B's (0.48 GiB against 2.2 estimated), where it splits the matmuls instead."""
    m = estimate_memory(arch, setup)
    frozen = NF4_BYTES if setup.mode == "qlora" else setup.c_bytes
    gathered = (arch.embedding_params + arch.num_layers * arch.layer_matrix_params) * frozen / setup.tp if setup.fsdp > 1 else 0.0
    return (m.params - m.grads + gathered + kv_cache_bytes(arch, setup, sequences, setup.seq_len)
            + sequences * arch.vocab_size * 4)


def _batch_seconds(arch: Architecture, hw, setup: TrainSetup, grpo: GrpoParams, mfu: float, utilisation: float,
                   compiled_flops: float | None) -> tuple:
    """(prefill, decode or None without a bandwidth figure, reference/old log-probabilities, updates: seconds;
    the update's FLOPs): one batch of rollouts and its num_iterations updates."""
    prompt, completion = grpo.max_prompt_length, grpo.max_completion_length
    length, seqs = prompt + completion, setup.per_device_batch
    sequences = grpo.batch_size * grpo.num_generations
    rate = hw.devices * hw.peak_tflops * 1e12 * mfu
    prefill_seconds = 2 * arch.params * sequences * prompt / rate
    decode_seconds = None
    if hw.hbm_gb_per_s:
        weights_read = arch.params * (NF4_BYTES if setup.mode == "qlora" else setup.c_bytes) / setup.tp
        cache_read = kv_cache_bytes(arch, setup, seqs, prompt + completion // 2)  # the cache is half full on average
        decode_seconds = completion * (weights_read + cache_read) / (hw.hbm_gb_per_s * 1e9 * utilisation)
    forward_passes = (1 if grpo.beta else 0) + (1 if grpo.num_iterations > 1 else 0)  # reference, old policy
    logps_seconds = forward_passes * 2 * arch.params * sequences * length / rate
    mode = "full" if setup.mode == "full" else "lora"
    update_flops = sequences * length * arch.train_flops_per_token(length, mode, setup.remat)
    if compiled_flops:
        update_flops = compiled_flops * setup.devices
    update_seconds = grpo.num_iterations * update_flops / rate
    return prefill_seconds, decode_seconds, logps_seconds, update_seconds, update_flops


def stage_row(plan: Plan, row: Row, grpo: GrpoParams, params: PlanParams, session_hours: float | None = None,
              compiled: dict | None = None) -> dict:
    """GRPO on one profile (the SFT row's mesh and dtypes); `compiled`: `grpo_xla.check`'s figures for it."""
    arch, hw, setup = plan.job.arch, row.hw, update_setup(row, grpo)
    prompt, length, seqs = grpo.max_prompt_length, grpo.max_prompt_length + grpo.max_completion_length, setup.per_device_batch
    m = estimate_memory(arch, setup)
    reference = reference_bytes(arch, setup, m.trainable_params) if grpo.beta else 0.0
    # generation: the decode step's program (the policy once: the update's input and output copies are not
    # live), the prefill's float32 logits over the prompt on top, and beside them the optimizer state and reference
    kv = kv_cache_bytes(arch, setup, seqs, length)
    decode = decode_program_bytes(arch, setup, seqs)
    prefill_logits = seqs * prompt * arch.vocab_size * 4
    update = m.peak + reference
    gen_x, upd_x = (compiled or {}).get("generation") or {}, (compiled or {}).get("update") or {}
    if "xla_gib" in gen_x:
        decode = gen_x["xla_gib"] * GIB
    generation = decode + prefill_logits + m.optimizer + reference
    if "xla_gib" in upd_x:  # the train step holds the policy and its optimizer; the reference beside it
        update = upd_x["xla_gib"] * GIB + reference

    sequences = grpo.batch_size * grpo.num_generations
    mfu, utilisation = hw.mfu or params.mfu, hw.decode_utilisation or params.decode_utilisation
    prefill_seconds, decode_seconds, logps_seconds, update_seconds, update_flops = _batch_seconds(
        arch, hw, setup, grpo, mfu, utilisation, upd_x.get("flops_per_device"))
    batches = math.ceil(grpo.max_steps / grpo.num_iterations)
    setup_hours = (hw.setup_minutes if hw.setup_minutes is not None else params.session_setup_minutes) / 60
    session = min((h for h in (session_hours, hw.session_hours) if h), default=None)
    out = {
        "session_hours": session,
        "sequences_per_device": seqs,
        "sequence_length": length,
        "generation_gib": round(generation / GIB, 3),
        "generation_from": "XLA:TPU" if "xla_gib" in gen_x else "estimate",
        "update_gib": round(update / GIB, 3),
        "update_from": "XLA:TPU" if "xla_gib" in upd_x else "estimate",
        "kv_cache_gib": round(kv / GIB, 3),
        "reference_gib": round(reference / GIB, 3),
        "usable_memory_gib": round(row.usable_bytes / GIB, 3),
        "fits": max(generation, update) <= row.usable_bytes,
        "decode_utilisation": utilisation,
        "mfu": mfu,
        "generation_seconds": None if decode_seconds is None else prefill_seconds + decode_seconds,
        "update_seconds": logps_seconds + update_seconds,
        "update_flops": update_flops,
        "update_flops_from": "XLA:TPU" if upd_x.get("flops_per_device") else "estimate",
        "rollout_batches": batches,
        "step_seconds": None, "samples_per_hour": None, "hours": None, "within_session": None, "cost": None,
    }
    if decode_seconds is None:  # no bandwidth for this profile: no time
        return out
    step = prefill_seconds + decode_seconds + logps_seconds + update_seconds
    saves = math.ceil(grpo.max_steps / grpo.checkpoint_every)
    hours = (batches * step + saves * row.checkpoint_seconds) / 3600 + setup_hours
    out.update(
        step_seconds=step,
        samples_per_hour=sequences * 3600 / step,
        hours=hours,
        within_session=session is None or hours <= session,
        cost=hours * hw.cost_per_hour if hw.cost_per_hour is not None else None,
    )
    return out


def add_grpo(plan: Plan, grpo: GrpoParams, params: PlanParams, session_hours: float | None = None,
             compiled: dict | None = None) -> Plan:
    """GRPO's figures on every profile, in `plan.grpo`; a warning when a phase does not fit or the session is short.
    `compiled`: XLA:TPU's figures for the selected profile (`grpo_xla.check`)."""
    if not grpo.enabled:
        return plan
    rows = {r.profile: stage_row(plan, r, grpo, params, session_hours,
                                 compiled if r.profile == plan.selected.profile else None) for r in plan.rows}
    selected = rows[plan.selected.profile]
    plan.grpo = {
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
        phase = "generation" if selected["generation_gib"] >= selected["update_gib"] else "update"
        plan.warnings.append(
            f"GRPO's {phase} needs {selected[phase + '_gib']:.2f} GiB per device on {hw} (of "
            f"{selected['usable_memory_gib']:.2f} usable): lower grpo.batch_size, num_generations or "
            "max_completion_length"
        )
    elif selected["within_session"] is False:
        plan.warnings.append(
            f"GRPO's {grpo.max_steps} steps take {selected['hours']:.1f} h on {hw}, over its "
            f"{selected['session_hours']:g} h session: lower grpo.max_steps, or split them over sessions"
        )
    if len(plan.warnings) > warned and plan.status == "ok":  # GRPO's own warnings (the padding one is about time)
        plan.status = "risky"
    return plan


def _time(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.3g}"


def markdown_section(plan: Plan) -> list[str]:
    g = plan.grpo
    s = g["selected"]
    fits = "fits" if s["fits"] else "**does not fit**"
    lines = [
        f"## GRPO ({g['loss_variant']}, {g['completions_per_step']} completions a step, reference {g['reference']})",
        "",
        f"On **{s['hardware']}**, {s['sequences_per_device']} sequences of {s['sequence_length']} tokens per device "
        f"({fits} the {size(s['usable_memory_gib'] * GIB)} usable):",
        "",
        "| phase | memory/device | from | time per step |",
        "|---|---:|---|---:|",
        f"| generation (KV cache {size(s['kv_cache_gib'] * GIB)}) | {size(s['generation_gib'] * GIB)} | "
        f"{s['generation_from']} | {_time(s['generation_seconds'])} s |",
        f"| update (reference {size(s['reference_gib'] * GIB)}) | {size(s['update_gib'] * GIB)} | "
        f"{s['update_from']} | {_time(s['update_seconds'])} s |",
        "",
    ]
    if s["hours"] is not None:
        lines += [f"{g['steps']} steps ({s['rollout_batches']} batches of rollouts), {s['samples_per_hour']:,.0f} "
                  f"completions an hour: {s['hours']:.3g} h with set-up"
                  + (f", within the {s['session_hours']:g} h session" if s["within_session"] and s["session_hours"]
                     else f", **over** the {s['session_hours']:g} h session" if s["session_hours"] else "")
                  + f". Decoding at {s['decode_utilisation']:g} of the HBM bandwidth and the update at MFU "
                  f"{s['mfu']:g}, both **assumed** ({plan.selected.hw.decode_source or 'plan.decode_utilisation'}).",
                  ""]
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


def xla_lines(x: dict) -> list[str]:
    out = []
    for phase, what in (("generation", "one decode step with the KV cache"),
                        ("update", "the policy update (GRPO loss on the reference's log-probabilities)")):
        r = x.get(phase) or {}
        if r.get("out_of_memory"):
            out.append(f"- {phase}: **XLA:TPU refuses {what} for {x['topology']}: it needs more than the chip's "
                       f"memory** ({r['error']})")
        elif "xla_gib" in r:
            out.append(f"- {phase}: {what} compiled by XLA:TPU for {x['topology']} ({r['method']}) in "
                       f"{r['seconds']:.0f} s: {size(r['xla_gib'] * GIB)} per chip, "
                       f"{r['flops_per_device'] / 1e12:,.3g} TFLOP per chip; the estimate of that program: "
                       f"{size(r['estimate_gib'] * GIB)} ({r['difference']:+.0%})")
        elif r.get("does_not_compile"):
            out.append(f"- {phase}: **does not compile for {x['topology']} (XLA:TPU):** {r['error']}")
        elif r.get("error"):
            out.append(f"- {phase}: not compiled: {r['error']}")
    return ["Checked against XLA:TPU (abstract shapes, no weights, no TPU needed):", ""] + out if out else []
