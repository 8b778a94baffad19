"""Which arithmetic can a base model already do? Greedy accuracy on `a op b =` after four solved examples.

    python benchmarks/base_arithmetic.py --model <output_root>/06_models/base_model

How the real-Gemma recipe's data was chosen (benchmarks/RESULTS.md, section 5): fine-tuning can teach
google/gemma-3-270m a format in 20 steps but not arithmetic it does not know, so the recipe trains on
the kind it gets right. Transformers (torch, CPU) on the converted fp32 folder; 32 random problems
per kind, the same for the same seed. Prints one JSON object: accuracy per kind and two samples.
"""

from __future__ import annotations

import argparse
import json
import random

KINDS = {  # (first operand range, operator, second operand range); subtraction keeps results >= 1
    "add_1_digit": ((1, 9), "+", (1, 9)),
    "add_2_digit": ((10, 40), "+", (2, 20)),
    "sub_within_20": ((1, 9), "-", (1, 11)),
    "sub_2_digit": ((2, 20), "-", (2, 40)),
    "mul_2_to_10": ((2, 10), "*", (2, 10)),
}


def problem(rng: random.Random, kind: str) -> tuple[int, str, int]:
    (lo1, hi1), op, (lo2, hi2) = KINDS[kind]
    a, b = rng.randint(lo1, hi1), rng.randint(lo2, hi2)
    return (a + b, op, a) if op == "-" else (a, op, b)  # a difference whose result is b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (the recipe's base_model)")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = random.Random(args.seed)
    results = {}
    for kind in KINDS:
        shots = "".join(f"{a} {op} {b} = {eval(f'{a}{op}{b}')}\n" for a, op, b in (problem(rng, kind) for _ in range(4)))
        problems = [problem(rng, kind) for _ in range(args.n)]
        batch = tokenizer([f"{shots}{a} {op} {b} =" for a, op, b in problems], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
        texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        answers = [(t.split() or [""])[0].rstrip(".") for t in texts]
        right = [ans == str(eval(f"{a}{op}{b}")) for (a, op, b), ans in zip(problems, answers)]
        results[kind] = {
            "accuracy": sum(right) / len(right),
            "samples": [f"{a} {op} {b} = {ans}" for (a, op, b), ans in zip(problems[:2], answers[:2])],
        }
    print(json.dumps({"model": args.model, "problems_per_kind": args.n, "few_shot": 4, "kinds": results}, indent=1))


if __name__ == "__main__":
    main()
