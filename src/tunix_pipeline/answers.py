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
