"""GRPO rewards: built-ins on well-formed and malformed completions, weights, custom rewards by dotted path."""

import sys
import types

import numpy as np
import pytest
from pydantic import ValidationError

from tunix_pipeline.config import GrpoParams, RewardParams
from tunix_pipeline.train import rewards
from tunix_pipeline.train.rewards import RewardSet

GOOD = "<reasoning>3 + 4 = 7.</reasoning><answer>7</answer>"
MALFORMED = [
    "",  # empty
    "7",  # no tags
    "<reasoning>3 + 4 = 7.</reasoning><answer>7",  # answer never closed
    "<reasoning>3 + 4 = 7.<answer>7</answer>",  # reasoning never closed
    "<answer>7</answer><reasoning>late</reasoning>",  # wrong order
    "<reasoning>a</reasoning><answer>7</answer><answer>8</answer>",  # two answers
    None,  # not even a string
]


def test_format_exact_accepts_only_the_reasoning_format():
    assert rewards.format_exact(None, [GOOD, GOOD + "<end_of_turn>", "  " + GOOD + "\n"]) == [1.0, 1.0, 1.0]
    assert rewards.format_exact(None, MALFORMED) == [0.0] * len(MALFORMED)


def test_format_approx_gives_partial_credit_per_tag():
    scores = rewards.format_approx(None, [GOOD, *MALFORMED])
    assert scores[0] == 1.0
    # "", "7", unclosed answer, unclosed reasoning, wrong order, two answers, None
    assert scores[1:] == [0.0, 0.0, 0.75, 0.75, 1.0, 0.0, 0.0]  # two answers: +0.25 +0.25 -0.25 -0.25


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        (GOOD, "7", 1.0),
        ("<reasoning>r</reasoning><answer> 1,000 </answer>", "1000", 1.0),  # commas and spaces
        ("<reasoning>r</reasoning><answer>7.0</answer>", "7", 1.0),  # numerically equal
        ("<reasoning>r</reasoning><answer>105</answer>", "100", 0.5),  # within 10%
        ("<reasoning>r</reasoning><answer>118</answer>", "100", 0.25),  # within 20%
        ("<reasoning>r</reasoning><answer>150</answer>", "100", 0.0),
        ("<reasoning>r</reasoning><answer>1</answer>", "0", 0.0),  # zero reference: absolute error
        ("<reasoning>r</reasoning><answer>0.05</answer>", "0", 0.5),
        ("<reasoning>r</reasoning><answer>Paris</answer>", "paris", 0.0),  # text: exact only
        ("<reasoning>r</reasoning><answer>Paris</answer>", "Paris", 1.0),
        ("<reasoning>r</reasoning><answer>nan</answer>", "7", 0.0),
        ("<reasoning>r</reasoning><answer>7", "7", 0.0),  # unclosed: no answer
        (None, "7", 0.0),
    ],
)
def test_answer_reward_with_partial_credit(completion, reference, expected):
    assert rewards.answer(None, [completion], answer=[reference]) == [expected]


def test_answer_reward_tolerance_and_missing_column():
    near = "<reasoning>r</reasoning><answer>7.001</answer>"
    assert rewards.answer(None, [near], answer=["7"]) == [0.5]
    assert rewards.answer(None, [near], answer=["7"], tolerance=0.01) == [1.0]
    with pytest.raises(ValueError, match="needs an `answer` column"):
        rewards.answer(None, [near])
    # an open-ended row has no answer to match (its reference is prose): 0, whatever the completion says
    right = "<reasoning>r</reasoning><answer>A sonnet.</answer>"
    assert rewards.answer(None, [right, right], answer=["A sonnet.", "A sonnet."], open_ended=["True", "False"]) == [0.0, 1.0]


def test_length_penalty():
    assert rewards.length_penalty(None, ["x" * 10, "x" * 15, "x" * 100], target_chars=10) == [0.0, -0.5, -1.0]


def _weighted_set(extra=()):
    return RewardSet(
        [RewardParams(fn="format_exact", weight=1.0), RewardParams(fn="answer", weight=2.0), *extra]
    )


def test_reward_set_scores_weights_and_tunix_functions():
    reward_set = _weighted_set()
    completions = [GOOD, "<reasoning>r</reasoning><answer>9</answer>", "garbage"]  # 9 vs 7: 29% off, no credit
    columns = {"answer": np.array(["7", "7", "7"]), "mode": "train", "trajectory_ids": ["0_0", "0_1", "0_2"]}
    scores = reward_set.score(["p"] * 3, completions, **columns)
    np.testing.assert_allclose(scores["format_exact"], [1, 1, 0])
    np.testing.assert_allclose(scores["answer"], [1, 0, 0])
    np.testing.assert_allclose(scores["total"], [3, 1, 0])

    fns = reward_set.tunix_reward_fns()
    assert [f.__name__ for f in fns] == ["format_exact", "answer"]
    assert fns[1](prompts=["p"] * 3, completions=completions, **columns) == [2.0, 0.0, 0.0]  # weighted
    metrics = reward_set.metric_fn(["p"] * 3, completions, rewards=np.array([3.0, 1.0, 0.0]), advantages=None)
    # means of a few 0/1 scores in float64: approx's default (1e-6 relative) only absorbs their rounding
    assert metrics["reward/answer/mean"][0] == pytest.approx(1 / 3)  # unweighted
    assert metrics["reward/answer/std"][0] == pytest.approx(np.std([1, 0, 0]))
    assert metrics["reward/total/mean"][0] == pytest.approx(4 / 3)


def test_tunix_sums_our_weighted_rewards():
    """Through Tunix's own reward manager, as GRPOLearner calls it."""
    from tunix.rl import reward_manager
    from tunix.rl.grpo import grpo_learner

    reward_set = _weighted_set()
    manager = reward_manager.SequenceRewardManager(
        reward_set.tunix_reward_fns(), grpo_learner.GRPOConfig(num_generations=2)
    )
    out = manager(prompts=["p", "p"], completions=[GOOD, "nope"], answer=np.array(["7", "7"]), mode="train")
    np.testing.assert_allclose(out["rewards"], [3.0, 0.0])
    assert "rewards/answer" in out["log_metrics"]


@pytest.fixture
def custom_module(monkeypatch):
    module = types.ModuleType("my_rewards")

    def brevity(prompts, completions, answer):  # no **kwargs: gets only what it names
        return [1.0 if len(c) < 20 else 0.0 for c in completions]

    def bad_length(prompts, completions, **columns):
        return [1.0]

    def not_numbers(prompts, completions, **columns):
        return ["high"] * len(completions)

    def nan_scores(prompts, completions, **columns):
        return [float("nan")] * len(completions)

    for fn in (brevity, bad_length, not_numbers, nan_scores):
        setattr(module, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    return module


def test_custom_reward_by_dotted_path(custom_module):
    reward_set = RewardSet([RewardParams(fn="my_rewards:brevity", weight=0.5), RewardParams(fn="format_exact")])
    scores = reward_set.score(["p", "p"], ["short", GOOD], answer=np.array(["7", "7"]), source=np.array(["a", "b"]))
    np.testing.assert_allclose(scores["brevity"], [1, 0])
    np.testing.assert_allclose(scores["total"], [0.5, 1.0])
    assert RewardSet([RewardParams(fn="my_rewards:nan_scores")]).score(["p"], ["x"])["nan_scores"].tolist() == [0.0]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("my_rewards:bad_length", r"returned 1 scores for 2 completions"),
        ("my_rewards:not_numbers", r"not a list of numbers"),
    ],
)
def test_custom_reward_that_misbehaves_is_named(custom_module, fn, message):
    with pytest.raises(ValueError, match=message):
        RewardSet([RewardParams(fn=fn)]).score(["p", "p"], ["a", "b"])


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("no_such_reward", "neither a built-in"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("tunix_pipeline.train.rewards:nothing_here", "has no function 'nothing_here'"),
    ],
)
def test_unknown_rewards_are_clear_errors(fn, message):
    with pytest.raises(ValueError, match=message):
        RewardSet([RewardParams(fn=fn)])


def test_grpo_config_validation():
    GrpoParams(max_steps=2)
    with pytest.raises(ValidationError, match="reward names must be unique"):
        GrpoParams(max_steps=2, rewards=[{"fn": "answer"}, {"fn": "answer", "weight": 2}])
    GrpoParams(max_steps=2, rewards=[{"fn": "answer"}, {"fn": "answer", "name": "answer_again"}])
    with pytest.raises(ValidationError, match="dapo has no KL term"):
        GrpoParams(max_steps=2, loss_variant="dapo")
    with pytest.raises(ValidationError, match="epsilon_high is a dapo setting"):
        GrpoParams(max_steps=2, epsilon_high=0.3)
    with pytest.raises(ValidationError, match="num_generations"):
        GrpoParams(max_steps=2, num_generations=1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        GrpoParams(max_steps=2, num_generation=4)
