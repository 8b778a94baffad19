"""A judge reward (`fn: judge`) in GRPO's plan: the judge's architecture, memory per device and time per step.

Where it runs (`judge.devices`):

- **null, time-shared**: the judge's weights, fsdp-sharded over the policy's mesh, stay beside the policy's
  through generation and the update; its scoring call runs between them, beside the policy's resident state
  (weights, optimizer state, reference).
- **N, a sub-mesh** of the last N devices: the policy (actor, reference, rollout) is planned on the others
  (`plan.evaluate` on the profile less N devices: data/fsdp resized). Scoring waits for generation and the
  update for the scores, so the judge's time still adds to the step.

One scoring call, per device: the judge's weights in `judge.dtype` over its devices (`memory.reference_bytes`,
a frozen copy), one layer's weights and the embedding all-gathered (fsdp), the forward's working set of one
layer at `batch_size` x `max_prompt_length` (`memory.forward_layer_bytes`), for `read: number` the KV cache of
prompt + `max_new_tokens` positions (`decode.kv_cache_bytes`), and the last position's float32 logits.
Time per step: every completion of the step scored in chunks of `batch_size` (padded): their prefill at the
profile's MFU and, for `read: number`, `max_new_tokens` decode steps a chunk (`decode.decode_step`).
`grpo_xla.check_judges` compiles the scoring call for the TPU topology; its figures then replace the estimate's.
"""

from __future__ import annotations

import math

from tunix_pipeline.config import GrpoParams, JudgeParams, ModelParams, PlanParams
from tunix_pipeline.models.architecture import Architecture, PlanError, resolve
from tunix_pipeline.planning.decode import decode_step, kv_cache_bytes
from tunix_pipeline.planning.memory import GIB, TrainSetup, forward_layer_bytes, reference_bytes
from tunix_pipeline.planning.plan import DoesNotFit, Plan, Row, evaluate, size


def judge_rewards(grpo: GrpoParams) -> list[tuple[str, JudgeParams]]:
    """(reward name, judge settings) of every `fn: judge` reward."""
    return [(r.name or r.fn, r.judge) for r in grpo.rewards if r.judge is not None]


def sub_mesh(grpo: GrpoParams) -> int:
    """Devices of the judges' own sub-mesh (the last N; judges with devices share the largest), 0: time-shared."""
    return max((j.devices or 0 for _, j in judge_rewards(grpo)), default=0)


def architectures(grpo: GrpoParams, params: PlanParams) -> dict[str, Architecture]:
    """Each judge's architecture, found as the policy's is (a local folder, the HF cache, `plan.architectures`)."""
    return {name: resolve(ModelParams(source=j.source, revision=j.revision, dtype=j.dtype, local_dir=j.local_dir),
                          params.architectures) for name, j in judge_rewards(grpo)}


def policy_row(plan: Plan, row: Row, grpo: GrpoParams, params: PlanParams) -> tuple[Row, str | None]:
    """(the policy's row: on the devices the judges' sub-mesh leaves, or `row` itself; why that layout cannot
    run on this profile, or None)."""
    n, total = sub_mesh(grpo), row.hw.devices
    if not n:
        return row, None
    if n >= total:
        return row, (f"judge.devices: {n} leaves the policy none of {row.profile}'s {total} devices: give the judge "
                     f"fewer (at most {total - 1}), or devices: null to time-share the policy's")
    policy = evaluate(plan.job, row.profile, row.hw.model_copy(update={"devices": total - n}), params)
    dp = policy.setup.data * policy.setup.fsdp
    completions = grpo.batch_size * grpo.num_generations
    micro = (grpo.micro_batch_size or grpo.batch_size) * grpo.num_generations
    if completions % dp or micro % dp:
        fit = [m for m in range(1, total) if not (completions % (total - m) or micro % (total - m))]
        return policy, (f"grpo.batch_size x num_generations ({completions}, micro-batches of {micro}) does not divide "
                        f"the {total - n} devices judge.devices: {n} leaves the policy: use "
                        + (f"judge.devices: {' or '.join(map(str, fit))}" if fit else "a batch that divides them"))
    return policy, None


def judge_setup(judge: JudgeParams, mesh: TrainSetup, devices: int | None) -> TrainSetup:
    """One scoring call's shapes on the judge's devices: its own `devices` on fsdp, else the policy's mesh."""
    positions = judge.max_prompt_length + (judge.max_new_tokens if judge.read == "number" else 0)
    base = mesh.replace(data=1, fsdp=devices, tp=1) if devices else mesh
    dp = base.data * base.fsdp
    per_device = judge.batch_size // dp if judge.batch_size % dp == 0 else judge.batch_size
    return base.replace(per_device_batch=per_device, seq_len=positions, param_dtype=judge.dtype, compute_dtype=None,
                        mode="full", grad_accum=1, remat="none", loss_chunk=None)


def scoring_bytes(arch: Architecture, judge: JudgeParams, setup: TrainSetup) -> dict:
    """Per device, one scoring call: the weights, and what the call adds to them (`working`)."""
    seqs, c, tp = setup.per_device_batch, setup.c_bytes, setup.tp
    weights = reference_bytes(arch, setup, 0)
    gathered = (arch.layer_matrix_params + arch.embedding_params) * c / tp if setup.fsdp > 1 else 0.0
    activations = forward_layer_bytes(arch, setup.replace(seq_len=judge.max_prompt_length))  # the prefill
    kv = kv_cache_bytes(arch, setup, seqs, setup.seq_len) if judge.read == "number" else 0.0
    logits = seqs * arch.vocab_size * 4  # the last position's only
    return {"weights": weights, "working": gathered + activations + kv + logits, "kv_cache": kv, "logits": logits,
            "activations": activations}


def scoring_seconds(arch: Architecture, hw, setup: TrainSetup, judge: JudgeParams, completions: int, devices: int,
                    mfu: float, compiled: dict) -> dict:
    """A step's scoring: `completions` in chunks of `batch_size`, each a prefill (at MFU) and, for `read: number`,
    `max_new_tokens` decode steps (their roofline over the profile's fraction); seconds None without one."""
    calls = math.ceil(completions / judge.batch_size)
    flops = 2 * arch.params * judge.batch_size * judge.max_prompt_length
    if compiled.get("flops_per_device"):
        flops = compiled["flops_per_device"] * devices
    prefill = calls * flops / (devices * hw.peak_tflops * 1e12 * mfu)
    step = None
    decode = 0.0
    if judge.read == "number":
        step = decode_step(arch, hw, setup, judge.max_prompt_length, judge.max_new_tokens)
        decode = None if step["seconds"] is None else calls * judge.max_new_tokens * step["seconds"]
    return {"calls": calls, "flops_per_call": flops, "flops_from": "XLA:TPU" if compiled.get("flops_per_device")
            else "estimate", "prefill_seconds": prefill, "decode_seconds": decode, "decode_step": step,
            "seconds": None if decode is None else prefill + decode}


def terms(plan: Plan, row: Row, policy: Row, grpo: GrpoParams, params: PlanParams, arches: dict,
          compiled: dict | None = None, problem: str | None = None) -> dict:
    """The judges on one profile: `shared` (bytes the time-shared judges hold on the policy's devices: weights
    beside both phases, `shared_peak` during scoring), their seconds a step, and the summary."""
    n = sub_mesh(grpo)
    mfu = row.hw.mfu or params.mfu
    completions = grpo.batch_size * grpo.num_generations
    judges, seconds = [], 0.0
    for name, j in judge_rewards(grpo):
        arch, devices = arches[name], (n if j.devices else policy.hw.devices)
        setup = judge_setup(j, policy.setup, n if j.devices else None)
        b = scoring_bytes(arch, j, setup)
        x = (compiled or {}).get(name) or {}
        # XLA:TPU's scoring call is the prefill: a `read: number` judge's KV cache comes on top
        peak = x["xla_gib"] * GIB + b["kv_cache"] if "xla_gib" in x else b["weights"] + b["working"]
        t = scoring_seconds(arch, row.hw, setup, j, completions, devices, mfu, x)
        seconds = None if seconds is None or t["seconds"] is None else seconds + t["seconds"]
        judges.append({
            "reward": name, "source": j.source, "architecture": arch.summary(), "dtype": j.dtype, "read": j.read,
            "layout": "sub-mesh" if j.devices else "time-shared", "devices": devices,
            "sequences_per_device": setup.per_device_batch, "positions": setup.seq_len,
            "weights_gib": round(b["weights"] / GIB, 3), "scoring_gib": round(peak / GIB, 3),
            "memory_from": "XLA:TPU" if "xla_gib" in x else "estimate", "kv_cache_gib": round(b["kv_cache"] / GIB, 3),
            "logits_gib": round(b["logits"] / GIB, 3), "xla": _xla_text(x), "_weights": b["weights"], "_working": peak - b["weights"], **t,
        })
    own = [d for d in judges if d["layout"] != "time-shared"]
    shared = [d for d in judges if d["layout"] == "time-shared"]
    # several judges in one place: all their weights, one scoring call at a time
    sub_peak = sum(d["_weights"] for d in own) + max((d["_working"] for d in own), default=0.0)
    out = {"shared": sum(d["_weights"] for d in shared),
           "shared_peak": sum(d["_weights"] for d in shared) + max((d["_working"] for d in shared), default=0.0),
           "seconds": seconds,
           "summary": {"judges": [{k: v for k, v in d.items() if not k.startswith("_")} for d in judges],
                       "sub_mesh_devices": n, "policy_devices": policy.hw.devices,
                       "sub_mesh_gib": round(sub_peak / GIB, 3) if own else None, "seconds": seconds,
                       "problem": problem}}
    return out


def _xla_text(x: dict) -> str | None:
    """XLA:TPU's scoring call against the estimate, in words; None when not compiled."""
    if x.get("out_of_memory"):
        return f"refused: over the chip's memory, {x['error']}"
    if "xla_gib" not in x:
        return x.get("error")
    return (f"{x['method']}, {x['xla_gib']:.2f} GiB and {x['flops_per_device'] / 1e12:,.3g} TFLOP per chip; the "
            f"estimate of that program {x['estimate_gib']:.2f} GiB ({x['difference']:+.0%})")


def refusal(s: dict, profile: str) -> PlanError | None:
    """Why the judges' layout on `profile` (`s`: its GRPO row) cannot run, as the error that fails the plan; None
    when it can: the layout itself, or memory over the usable (the judges' own devices, or the policy's)."""
    j, usable = s["judge"], s["usable_memory_gib"]
    if j["problem"]:
        return PlanError(f"GRPO's judge on {profile}: {j['problem']}")
    over = [(f"on its {j['sub_mesh_devices']} devices", j["sub_mesh_gib"])] if j["sub_mesh_gib"] else []
    if j["shared_scoring_gib"] is not None:
        over.append(("time-shared, scoring beside the policy's weights, optimizer state and reference",
                     j["shared_scoring_gib"]))
        over += [(f"time-shared, its weights beside the policy's {phase}", s[f"{phase}_gib"])
                 for phase in ("generation", "update")]
    where = [(text, gib) for text, gib in over if gib > usable]
    if not where:
        return None
    text, gib = max(where, key=lambda w: w[1])
    names = ", ".join(f"{d['reward']} ({d['architecture']['name']}, {d['dtype']}, weights {d['weights_gib']:.2f} GiB, "
                      f"one call of {d['sequences_per_device']} x {d['positions']} tokens {d['scoring_gib']:.2f} GiB)"
                      for d in j["judges"])
    return DoesNotFit(
        f"GRPO's judge does not fit {profile}: {size(gib * GIB)} per device {text}, "
        f"{size(usable * GIB)} usable ({names}): lower judge.batch_size or max_prompt_length, judge.dtype: bfloat16, "
        + ("more judge.devices" if j["sub_mesh_gib"] else "give it its own devices (judge.devices: N)")
        + ", or a smaller judge; `kedro run --pipelines=plan` shows every profile")


def markdown_lines(s: dict) -> list[str]:
    """The judges' rows of GRPO's section: memory per device, where it runs, time per step."""
    j = s["judge"]
    lines = []
    for d in j["judges"]:
        arch = d["architecture"]
        t = "—" if d["seconds"] is None else f"{d['seconds']:.3g} s"
        lines.append(
            f"- judge `{d['reward']}`: {arch['name']} ({arch['model_type']}, {arch['params'] / 1e9:.2f}B, {d['dtype']}, "
            f"read {d['read']}), {d['layout']} on {d['devices']} devices: weights {size(d['weights_gib'] * GIB)} and "
            f"one scoring call of {d['sequences_per_device']} x {d['positions']} tokens {size(d['scoring_gib'] * GIB)} "
            f"per device ({d['memory_from']}); {d['calls']} calls a step, {t} ({d['flops_from']} FLOPs at MFU"
            + (", then the decode steps" if d["read"] == "number" else "") + ")"
            + (f"; XLA:TPU compiled the call for these chips ({d['xla']})" if d.get("xla") else ""))
    if j["sub_mesh_devices"]:
        lines.append(f"- the policy runs on the other {j['policy_devices']} devices (the memory and times above); "
                     "scoring waits for generation and the update for the scores, so the judge's time adds to the step")
    else:
        lines.append("- the judge's weights are in the generation and update rows above; its scoring runs between "
                     "them and adds to the step")
    return lines + [""]
