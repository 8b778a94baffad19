"""A small, deterministic reasoning dataset with checkable answers.

It is what the offline `smoke` run and the tests train on. The same problems are
written in three source formats (GSM8K-style JSONL, Alpaca-style CSV, chat
`messages` JSONL) so that ingest exercises each reader and format.

Regenerate the committed files with `python -m tunix_pipeline.synthetic`.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards"]


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


def generate(n: int = 400, seed: int = 0) -> list[dict]:
    """`n` distinct problems, always the same for the same seed."""
    rng = random.Random(seed)
    problems, seen = [], set()
    while len(problems) < n:
        p = _problem(rng)
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
            completion = f"<reasoning>{p['reasoning']}</reasoning><answer>{p['answer']}</answer>"
            messages = [
                {"role": "user", "content": p["question"]},
                {"role": "assistant", "content": completion},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return [gsm_path, alpaca_path, chat_path]


if __name__ == "__main__":
    for path in write_raw_files(Path("data/01_raw")):
        print(path)
