"""The reasoning format, in one place: `<reasoning>…</reasoning><answer>…</answer>`.

Formatting renders it, ingest parses it out of tagged sources, evaluation and
the GRPO rewards clean completions, read the answer and match it against the
reference. Changing the tags or the matching rule means editing this module only.
"""

from __future__ import annotations

import math
import re

# what closes the model's turn in Gemma's chat format (the formatting stage appends it to completions)
GEMMA_END_OF_TURN = "<end_of_turn>"
TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
_TAGGED = re.compile(r"^\s*<reasoning>(.*?)</reasoning>\s*<answer>(.*?)</answer>\s*$", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
# lm-evaluation-harness's gsm8k "flexible-extract": a run of digits, signs, $ . and , (or a lone digit)
_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def render(reasoning: str, answer: str) -> str:
    return f"<reasoning>{reasoning}</reasoning><answer>{answer}</answer>"


def parse(text: str) -> tuple[str, str] | None:
    """(reasoning, answer), stripped, when `text` is exactly the format (space around it allowed); else None."""
    tagged = _TAGGED.match(text)
    return (tagged.group(1).strip(), tagged.group(2).strip()) if tagged else None


def well_formed(text: str) -> bool:
    """Exactly the format, each tag once, with a non-empty reasoning and answer."""
    tagged = _TAGGED.match(text)
    return bool(tagged and tagged.group(1) and tagged.group(2)) and all(text.count(tag) == 1 for tag in TAGS)


def extract_answer(text: str) -> str | None:
    """The text inside the first <answer>…</answer>, or None."""
    match = _ANSWER.search(text)
    return match.group(1).strip() if match else None


def through_answer(text: str) -> str:
    """The text up to and including its first `</answer>`: generation stops there, so what a model would write
    after it is never read, whichever backend generated it."""
    head, closed, _ = text.partition(TAGS[3])
    return head + closed


def last_number(text: str) -> str | None:
    """The lenient reading (GSM8K's flexible rule): the last number in the text, without $, commas or a final
    period."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    last = next(group for group in numbers[-1] if group)
    return last.replace("$", "").replace(",", "").rstrip(".") or None


def clean(completion) -> str:
    """A generated completion as text, without the end-of-turn marker or surrounding space ("" if not text)."""
    if not isinstance(completion, str):
        return ""
    return completion.replace(GEMMA_END_OF_TURN, "").strip()


def normal(answer: str) -> str:
    """An answer as compared: trimmed, without thousands separators."""
    return str(answer).strip().replace(",", "")


def number(answer: str) -> float | None:
    """The answer as a finite number, or None."""
    try:
        value = float(normal(answer))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def answers_match(predicted: str | None, reference: str, tolerance: float) -> bool:
    """Equal after `normal`, or numerically equal within `tolerance`."""
    if predicted is None:
        return False
    if normal(predicted) == normal(reference):
        return True
    x, y = number(predicted), number(reference)
    return x is not None and y is not None and abs(x - y) <= tolerance


def readings(completion, reference, tolerance: float = 1e-6) -> dict:
    """A completion read the three ways evaluation reports (the same rule for our backend and lm-eval's):
    `strict` (the answer inside a closed `<answer>` tag is right), `lenient` (the last number is right) and
    `format` (exactly the reasoning format); `extracted` / `lenient_answer`: what each reading found."""
    text = through_answer(clean(completion))
    extracted, lenient = extract_answer(text), last_number(text)
    return {"text": text, "extracted": extracted, "lenient_answer": lenient,
            "strict": answers_match(extracted, str(reference), tolerance),
            "lenient": answers_match(lenient, str(reference), tolerance), "format": well_formed(text)}


def answer_score(predicted: str | None, reference, tolerance: float = 1e-6) -> float:
    """1 for a right answer (an empty reference matches nothing); 0.5 within 10% and 0.25 within 20% of a
    numeric reference; else 0."""
    if predicted is None:
        return 0.0
    if normal(reference) and answers_match(predicted, reference, tolerance):
        return 1.0
    g, r = number(predicted), number(reference)
    if g is None or r is None:
        return 0.0
    error = abs(g - r) / max(abs(r), 1.0)
    return 0.5 if error <= 0.1 else 0.25 if error <= 0.2 else 0.0
