import csv
import json
import re

import pytest

from tunix_pipeline.data.synthetic import generate, write_raw_files, write_times_file

from .conftest import ROOT


def test_committed_raw_data_is_what_the_generator_writes(tmp_path):
    write_raw_files(tmp_path)
    write_times_file(tmp_path)
    for name in ("arith_gsm8k.jsonl", "arith_alpaca.csv", "arith_chat.jsonl", "times_gsm8k.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "data" / "01_raw" / name).read_text(), name


@pytest.mark.parametrize("level", ["two_step", "times"])
def test_answers_follow_from_the_reasoning(level):
    for problem in generate(200, seed=3, level=level):
        # the last equation of the reasoning states the answer, and it is right
        *_, (lhs, result) = re.findall(r"(\d+ [-+*] \d+) = (\d+)", problem["reasoning"])
        assert eval(lhs) == int(result) == int(problem["answer"])


def test_files_hold_every_problem_once(tmp_path):
    write_raw_files(tmp_path, n=40)
    gsm = [json.loads(line) for line in (tmp_path / "arith_gsm8k.jsonl").open()]
    alpaca = list(csv.DictReader((tmp_path / "arith_alpaca.csv").open()))
    chat = [json.loads(line) for line in (tmp_path / "arith_chat.jsonl").open()]
    assert len(gsm) + len(alpaca) + len(chat) == 40
    assert all("####" in row["answer"] for row in gsm)


def test_times_problems_are_one_multiplication_of_small_factors():
    problems = generate(600, level="times")
    assert len({p["question"] for p in problems}) == 600
    for p in problems:
        (a, b), = [tuple(map(int, m)) for m in re.findall(r"^(\d+) \* (\d+) = \d+\.$", p["reasoning"])]
        assert 2 <= a <= 10 and 2 <= b <= 10 and f"has {a} " in p["question"] and f"with {b} " in p["question"]
