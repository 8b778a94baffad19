"""GRPO reward functions, and the weighted set a run uses.

Every reward has Tunix's signature: `(prompts, completions, **columns) -> list[float]`,
one score per completion; `columns` are the dataset's other columns, repeated per
completion (`answer`, `id`, `source`, `reference`, `open_ended`). Built-ins:

| name | scores | range |
|---|---|---|
| `format_exact` | exactly `<reasoning>…</reasoning><answer>…</answer>` | 0 or 1 |
| `format_approx` | each of the four tags: +0.25 once, -0.25 repeated, 0 missing | -1 … 1 |
| `answer` | 1 correct (exact, or numeric within `tolerance`); near numeric answers get partial credit; 0 on open-ended rows | 0 … 1 |
| `length_penalty` | minus the share by which a completion exceeds `target_chars` | -1 … 0 |
| `judge` | a judge model's score with a rubric (`judge:` settings, `judge.Judge`) | 0 … 1 |

Custom rewards are named by dotted path, `package.module:function`.
Malformed completions (no tags, unclosed tags, empty, not a string) score low; they never raise.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence

import numpy as np

from tunix_pipeline.config import RewardParams
from tunix_pipeline.config.validation import closest
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.data.answers import TAGS, answer_score, clean, extract_answer, well_formed
from tunix_pipeline.train.judge import Judge

# dataset columns passed to every reward as keyword arguments (besides prompts/completions)
REWARD_COLUMNS = {"answer": "answer", "id": "id", "source": "source", "reference": "completion",
                  "open_ended": "open_ended"}


class RewardError(UserError, ValueError):
    """A `grpo.rewards` entry that names no usable reward function, or one that returns unusable scores."""


# keys Tunix adds to the reward call that are not dataset columns
_TUNIX_KEYS = {"mode", "trajectory_ids"}


def format_exact(prompts, completions, **_) -> list[float]:
    return [1.0 if well_formed(clean(c)) else 0.0 for c in completions]


def format_approx(prompts, completions, **_) -> list[float]:
    scores = []
    for c in completions:
        text = clean(c)
        score = 0.0
        for tag in TAGS:
            n = text.count(tag)
            score += 0.25 if n == 1 else (-0.25 if n > 1 else 0.0)
        scores.append(score)
    return scores


def answer(prompts, completions, answer=None, tolerance: float = 1e-6, open_ended=None, **_) -> list[float]:
    """Open-ended rows (no answer to match: a judge scores those) get 0 from every completion."""
    if answer is None:
        raise ValueError("the `answer` reward needs an `answer` column")
    no_answer = [False] * len(completions) if open_ended is None else [str(o) == "True" for o in open_ended]
    return [0.0 if skip else answer_score(extract_answer(clean(c)), a, tolerance)
            for c, a, skip in zip(completions, answer, no_answer)]


def length_penalty(prompts, completions, target_chars: int = 200, **_) -> list[float]:
    return [-min(1.0, max(0, len(clean(c)) - target_chars) / target_chars) for c in completions]


BUILTIN: dict[str, Callable[..., list[float]]] = {
    "format_exact": format_exact,
    "format_approx": format_approx,
    "answer": answer,
    "length_penalty": length_penalty,
}


def resolve(spec: str) -> Callable[..., list[float]]:
    """A built-in reward by name, or `package.module:function` (`judge` is built by `RewardSet`, with its settings)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(
            f"reward {spec!r} is neither a built-in ({', '.join(BUILTIN)}, judge) nor a dotted path "
            f"`package.module:function`{closest(spec, [*BUILTIN, 'judge'])}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {module_name} has no function {attr!r}")
    return fn


def _accepted(fn, kwargs: dict) -> dict:
    """Only the keyword arguments `fn` takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


class RewardSet:
    """The configured rewards: raw scores per reward, their weighted total, and Tunix hooks.

    `tunix_reward_fns()` are what `GRPOLearner` sums (each weighted); `metric_fn`
    logs each reward's unweighted mean and spread and the total's spread, and each judge's time, malformed
    replies and label mass. Judges load onto `judge_mesh` (default: the devices' own) at their first call.
    """

    def __init__(self, specs: Sequence[RewardParams], judge_mesh=None):
        self.specs = list(specs)
        self.fns = [Judge(s.judge, judge_mesh) if s.judge is not None else resolve(s.fn) for s in self.specs]
        self.names = [s.name or s.fn.rsplit(":", 1)[-1] for s in self.specs]
        self.weights = {n: s.weight for n, s in zip(self.names, self.specs)}
        self.judges = [n for n, fn in zip(self.names, self.fns) if isinstance(fn, Judge)]
        self._last: dict[str, np.ndarray] = {}

    def score_one(self, i: int, prompts, completions, **columns) -> np.ndarray:
        spec, fn, name = self.specs[i], self.fns[i], self.names[i]
        columns = {k: v for k, v in columns.items() if k not in _TUNIX_KEYS}
        out = fn(prompts=list(prompts), completions=list(completions), **_accepted(fn, {**columns, **spec.kwargs}))
        try:
            values = np.asarray(out, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as err:
            raise RewardError(f"reward {name!r} returned {type(out).__name__}, not a list of numbers") from err
        if values.shape[0] != len(completions):
            raise RewardError(f"reward {name!r} returned {values.shape[0]} scores for {len(completions)} completions")
        values = np.where(np.isfinite(values), values, 0.0)  # a NaN/inf score counts as 0
        self._last[name] = values
        return values

    def score(self, prompts, completions, **columns) -> dict[str, np.ndarray]:
        """Unweighted scores of every reward, plus `total` (the weighted sum GRPO optimises)."""
        raw = {n: self.score_one(i, prompts, completions, **columns) for i, n in enumerate(self.names)}
        raw["total"] = sum(self.weights[n] * raw[n] for n in self.names)
        return raw

    def tunix_reward_fns(self) -> list[Callable[..., list[float]]]:
        def weighted(i: int):
            def fn(prompts, completions, **kwargs):
                return list(self.weights[self.names[i]] * self.score_one(i, prompts, completions, **kwargs))

            fn.__name__ = self.names[i]  # Tunix logs rewards/<name> (weighted mean)
            return fn

        return [weighted(i) for i in range(len(self.fns))]

    def metric_fn(self, prompts, completions, rewards, advantages, **_) -> dict:
        """Tunix metric fn: each reward's unweighted mean and std (from the scores just computed), the total's std."""
        metrics = {}
        for name in self.names:
            values = self._last.get(name)
            if values is not None and len(values):
                metrics[f"reward/{name}/mean"] = (float(np.mean(values)), np.mean)
                metrics[f"reward/{name}/std"] = (float(np.std(values)), np.mean)
        for name, fn in zip(self.names, self.fns):
            if isinstance(fn, Judge) and fn.last is not None:
                metrics[f"judge/{name}/seconds"] = (fn.last.seconds, np.mean)
                metrics[f"judge/{name}/malformed"] = (float(fn.last.malformed), np.mean)
                if fn.last.label_mass is not None:
                    metrics[f"judge/{name}/label_mass"] = (fn.last.label_mass, np.mean)
        total = np.asarray(rewards, dtype=np.float64)
        metrics["reward/total/mean"] = (float(np.mean(total)), np.mean)
        metrics["reward/total/std"] = (float(np.std(total)), np.mean)
        return metrics
