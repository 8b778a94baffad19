"""Scoring in the plan: what generating for the evaluation, and for SFT's dev evaluation between its steps, holds
per device, so that the sft preflight stops a run whose scoring cannot fit before SFT starts, not hours into it.

Our `Generator` (continuous batching over `upstream.Sampler`) holds, per device: the policy once, as scoring loads
it; a KV cache of `batch_size` rows (split over the data-parallel devices where they divide) x (the prompt length +
twice `max_new_tokens`: the rows share one write index); a step's float32 logits over the vocabulary; the prefill's
float32 hidden states over the prompt. The evaluation loads the model unquantized in `model.dtype` and computes in
it; the dev evaluation samples from the model as it trains (in `sft.compute_dtype`). The prompt length is the
longest prompt scored rounded up to a power of two, or `evaluate.max_prompt_length` (`generation.select_prompts`): a
few-shot prompt's is the longest. SFT's dev evaluation runs between steps beside the trainer's state (the weights as
trained and the optimizer's), not beside a step's activations.
"""

from __future__ import annotations

from tunix_pipeline.config import DevEvalParams, EvaluateParams
from tunix_pipeline.models.architecture import Architecture
from tunix_pipeline.planning.decode import kv_cache_bytes
from tunix_pipeline.planning.memory import GIB, TrainSetup, estimate_memory
from tunix_pipeline.planning.plan import Plan, process_peak_gib, size

FIX = {"evaluation": "lower evaluate.batch_size or evaluate.max_new_tokens, or set evaluate.max_prompt_length",
       "dev evaluation": "lower sft.dev_eval.batch_size or sft.dev_eval.max_new_tokens"}


def generation_bytes(arch: Architecture, setup: TrainSetup, rows: int, prompt_length: int, max_new_tokens: int) -> float:
    """Per device, beside the weights: the sampler's cache, a step's logits and the prefill's hidden states."""
    dp = setup.data * setup.fsdp
    rows = rows // dp if rows % dp == 0 else rows
    return (kv_cache_bytes(arch, setup, rows, prompt_length + 2 * max_new_tokens)
            + rows * (arch.vocab_size + prompt_length * arch.hidden_size) * 4)


def add_scoring(plan: Plan, evaluate: EvaluateParams, prompt_length: int | None, dev_eval: DevEvalParams | None,
                dev_prompt_length: int | None) -> Plan:
    """`plan` with `scoring`: each scoring phase that will run (a prompt length known for it) on the selected
    profile, its bytes per device and whether they fit; one that does not fit makes the plan `over`."""
    row, arch = plan.selected, plan.job.arch
    m = row.memory
    phases = {}
    if prompt_length:
        loaded = row.setup.replace(compute_dtype=None, mode="lora" if row.setup.mode == "qlora" else row.setup.mode)
        weights = estimate_memory(arch, loaded)
        phases["evaluation"] = (weights.params - weights.grads + generation_bytes(
            arch, loaded, evaluate.batch_size, prompt_length, evaluate.max_new_tokens), evaluate.batch_size,
            prompt_length + 2 * evaluate.max_new_tokens)
    if dev_eval is not None and dev_prompt_length and plan.job.max_steps:
        phases["dev evaluation"] = (m.params + m.optimizer + generation_bytes(
            arch, row.setup, dev_eval.batch_size, dev_prompt_length, dev_eval.max_new_tokens), dev_eval.batch_size,
            dev_prompt_length + 2 * dev_eval.max_new_tokens)
    # on the CPU the run plans on, the process's resident peak too (what it held when planned beside the phase)
    plan.scoring = {name: {"gib": round(held / GIB, 3), "rows": rows, "cache_positions": positions,
                           "fits": held <= row.usable_bytes, "process_peak_gib": process_peak_gib(row.hw, held)}
                    for name, (held, rows, positions) in phases.items()}
    if not all(p["fits"] for p in plan.scoring.values()):
        plan.status = "over"
    return plan


def refusal(plan: Plan) -> str | None:
    """The first scoring phase that cannot fit the selected profile, in one line with what lowers it; None if all do."""
    for name, p in (plan.scoring or {}).items():
        if not p["fits"]:
            return (f"the {name} needs {size(p['gib'] * GIB)} per device on {plan.selected.profile} (estimate: the "
                    f"weights, a KV cache of {p['rows']} rows x {p['cache_positions']} positions, a step's logits; of "
                    f"{size(plan.selected.usable_bytes)} usable): {FIX[name]}; stopped before SFT, nothing trained")
    return None


def markdown_lines(plan: Plan) -> list[str]:
    if not plan.scoring:
        return []
    lines = ["| scoring | rows x cache positions | memory/device (estimate) | fits |", "|---|---|---:|---|"]
    lines += [f"| {name} | {p['rows']} x {p['cache_positions']:,} | {size(p['gib'] * GIB)} | "
              f"{'yes' if p['fits'] else '**no**'} |" for name, p in plan.scoring.items()]
    return lines + [""]
