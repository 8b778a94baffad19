"""A small, deterministic reasoning dataset with checkable answers.

It is what the offline `smoke` run and the tests train on. The same problems are
written in three source formats (GSM8K-style JSONL, Alpaca-style CSV, chat
`messages` JSONL) so that ingest exercises each reader and format.

A second, easier set (`times_gsm8k.jsonl`, one-step multiplication with factors 2-10)
is what the real-Gemma recipe (`conf/gemma3_270m_cpu`) trains on: google/gemma-3-270m
knows its times tables (88 % right, few-shot and greedy: benchmarks/base_arithmetic.py) but
not the two-digit sums and differences of the first set (38 % and 3 %), so fine-tuning can
teach it the format and be judged on answers it can reach.

Regenerate the committed files with `python -m tunix_pipeline.data.synthetic`.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from tunix_pipeline.data import answers

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards"]
TIMES_ROWS = 600  # the recipe holds out ~140 of them (its DPO check needs >= 128 held-out prompts)


def _problem(rng: random.Random) -> dict:
    """One word problem: question, step-by-step reasoning and integer answer."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 6)
    kind = rng.choice(["add_mul", "sub_add", "mul_sub"])
    if kind == "add_mul":
        question = (
            f"{name} has {a} {item}. {other} gives {name} {b} more. "
            f"Then {name} collects {c} times as many. How many {item} does {name} have?"
        )
        mid = a + b
        answer = mid * c
        reasoning = f"{name} starts with {a}. {a} + {b} = {mid}. {mid} * {c} = {answer}."
    elif kind == "sub_add":
        a = a + b
        question = (
            f"{name} has {a} {item} and gives {b} to {other}. "
            f"Then {name} finds {c} more. How many {item} does {name} have now?"
        )
        mid = a - b
        answer = mid + c
        reasoning = f"{name} starts with {a}. {a} - {b} = {mid}. {mid} + {c} = {answer}."
    else:
        question = (
            f"{name} buys {c} boxes of {item} with {b} in each box, "
            f"then gives {a % (b * c) or 1} to {other}. How many {item} are left?"
        )
        mid = b * c
        gift = a % mid or 1
        answer = mid - gift
        reasoning = f"{c} * {b} = {mid}. {mid} - {gift} = {answer}."
    return {"question": question, "reasoning": reasoning, "answer": str(answer)}


def _times_problem(rng: random.Random) -> dict:
    """One multiplication word problem with factors 2-10: a single step from the question to the answer."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    groups, each = rng.randint(2, 10), rng.randint(2, 10)
    container = rng.choice(["boxes", "bags", "jars", "rows"])
    question = (
        f"{name} has {groups} {container} of {item} with {each} {item} in each. "
        f"How many {item} does {name} have?"
    )
    answer = groups * each
    return {"question": question, "reasoning": f"{groups} * {each} = {answer}.", "answer": str(answer)}


LEVELS = {"two_step": _problem, "times": _times_problem}


def generate(n: int = 400, seed: int = 0, level: str = "two_step") -> list[dict]:
    """`n` distinct problems of `level` (two_step | times), always the same for the same seed."""
    make = LEVELS[level]
    rng = random.Random(seed)
    problems, seen = [], set()
    while len(problems) < n:
        p = make(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            problems.append(p)
    return problems


def write_raw_files(out_dir: str | Path, n: int = 400, seed: int = 0) -> list[Path]:
    """Writes the problems split over three files, one per source format."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems = generate(n, seed)
    third = n // 4
    gsm, alpaca, chat = problems[: 2 * third], problems[2 * third : 3 * third], problems[3 * third :]

    gsm_path = out / "arith_gsm8k.jsonl"
    with gsm_path.open("w") as f:
        for p in gsm:
            row = {"question": p["question"], "answer": f"{p['reasoning']}\n#### {p['answer']}"}
            f.write(json.dumps(row) + "\n")

    alpaca_path = out / "arith_alpaca.csv"
    with alpaca_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        for p in alpaca:
            writer.writerow(
                {
                    "instruction": "Solve the word problem.",
                    "input": p["question"],
                    "output": f"{p['reasoning']}\n#### {p['answer']}",
                }
            )

    chat_path = out / "arith_chat.jsonl"
    with chat_path.open("w") as f:
        for p in chat:
            completion = answers.render(p["reasoning"], p["answer"])
            messages = [
                {"role": "user", "content": p["question"]},
                {"role": "assistant", "content": completion},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return [gsm_path, alpaca_path, chat_path]


def write_times_file(out_dir: str | Path, n: int = TIMES_ROWS, seed: int = 0) -> Path:
    """The one-step multiplication set as one GSM8K-style file (reasoning, then `#### answer`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "times_gsm8k.jsonl"
    with path.open("w") as f:
        for p in generate(n, seed, level="times"):
            f.write(json.dumps({"question": p["question"], "answer": f"{p['reasoning']}\n#### {p['answer']}"}) + "\n")
    return path


if __name__ == "__main__":
    for path in [*write_raw_files(Path("data/01_raw")), write_times_file(Path("data/01_raw"))]:
        print(path)
