"""The statistics behind a quality claim: an accuracy's 95% interval and a paired test of two models.

- `wilson_interval`: the Wilson score interval of k right of n (it stays inside [0, 1] and is honest at 0 or n
  right, where the normal approximation gives an interval of width zero);
- `mcnemar`: two models scored on the same problems, compared on the problems only one of them got right
  (the exact, binomial form of McNemar's test: two-sided, no continuity correction needed).
"""

from __future__ import annotations

from scipy.stats import binomtest


def wilson_interval(right: int, total: int, confidence: float = 0.95) -> dict | None:
    """{"low", "high"}: the Wilson score interval of `right` of `total`; None with nothing scored."""
    if total <= 0:
        return None
    interval = binomtest(int(right), int(total)).proportion_ci(confidence, method="wilson")
    return {"low": float(interval.low), "high": float(interval.high)}


def mcnemar(parent: list[bool], model: list[bool]) -> dict:
    """`model` against `parent`, problem by problem: how many only the model got right (`gained`), how many only the
    parent (`lost`), and the exact McNemar p-value (two-sided) that the two are equally good."""
    if len(parent) != len(model):
        raise ValueError(f"paired scores need the same problems: {len(parent)} against {len(model)}")
    gained = sum(m and not p for p, m in zip(parent, model))
    lost = sum(p and not m for p, m in zip(parent, model))
    p_value = binomtest(gained, gained + lost, 0.5).pvalue if gained + lost else 1.0
    return {"problems": len(model), "gained": gained, "lost": lost, "p_value": float(p_value)}
