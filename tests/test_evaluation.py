"""Evaluation metrics on hand-checked cases, generation with Tunix's sampler, and the edge cases."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from tunix_pipeline import upstream
from tunix_pipeline.config import EvaluateParams, ModelParams, RuntimeParams
from tunix_pipeline.data import answers
from tunix_pipeline.evaluate import evaluation, significance
from tunix_pipeline.generate import generation
from tunix_pipeline.upstream import sampling
from tunix_pipeline.evaluate.evaluation import (
    answers_match, exact_match, majority_answer, markdown_table, pass_at_k, score,
)

MESH = RuntimeParams(mesh={"fsdp": 4, "tp": 2})


def _formatted(answers):
    return pd.DataFrame(
        {
            "id": [f"q{i}" for i in range(len(answers))],
            "prompt": [f"<bos><start_of_turn>user\nq{i}<end_of_turn>\n<start_of_turn>model\n" for i in range(len(answers))],
            "answer": answers,
        }
    )


def _gen(answer: str, closed: bool = True) -> str:
    return f"<reasoning>r</reasoning><answer>{answer}</answer>" if closed else f"<reasoning>r</reasoning><answer>{answer}"


# ---------------------------------------------------------------- answers
@pytest.mark.parametrize(
    ("predicted", "reference", "exact", "match"),
    [
        ("42", "42", True, True),
        (" 1,234 ", "1234", True, True),
        ("42.0", "42", False, True),
        ("42.0000001", "42", False, True),  # within 1e-6
        ("42.001", "42", False, False),
        ("nan", "nan", True, True),  # same text
        ("inf", "1e400", False, False),
        ("Paris", "Paris", True, True),
        ("paris", "Paris", False, False),
        (None, "42", False, False),
    ],
)
def test_answer_matching(predicted, reference, exact, match):
    assert exact_match(predicted, reference) is exact
    assert answers_match(predicted, reference, 1e-6) is match


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    # ratios of small counts in float64: approx's default (1e-6 relative) only absorbs their rounding
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)


def test_majority_vote():
    assert majority_answer(["12", "12.0", "13", None]) == "12"  # 12 and 12.0 vote together
    assert majority_answer(["13", "12", None, None]) == "13"  # tie: first drawn
    assert majority_answer([None, None]) is None
    assert majority_answer(["a", "b", "b"]) == "b"


@pytest.mark.parametrize(
    ("text", "lenient"),
    [
        ("So she has 3 + 4 = 7 apples. The answer is 7.", "7"),  # the last number, its final period dropped
        ("<reasoning>$1,200 / 2 = $600</reasoning><answer>$600</answer>", "600"),  # $ and commas dropped
        ("<reasoning>2 x 3 = 6</reasoning><answer>6</answer> then 99", "6"),  # nothing after </answer> is read
        ("He pays -5 dollars", "-5"),
        ("no number here", None),
        ("Answer: ...", None),
    ],
)
def test_lenient_reading_is_the_last_number_up_to_the_closing_answer_tag(text, lenient):
    assert answers.readings(text, "0")["lenient_answer"] == lenient


def test_wilson_interval_by_hand():
    z = 1.959963984540054  # the normal quantile of a 95% interval

    def by_hand(k, n):
        centre, half = (k + z * z / 2) / (n + z * z), z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
        return centre - half, centre + half

    for k, n in ((1, 48), (0, 64), (64, 64), (660, 1319)):
        interval = significance.wilson_interval(k, n)
        assert (interval["low"], interval["high"]) == pytest.approx(by_hand(k, n), abs=1e-9)
    assert significance.wilson_interval(1, 48)["high"] == pytest.approx(0.1090, abs=1e-4)  # the "0.1-11%" of 1/48
    assert significance.wilson_interval(0, 0) is None


def test_mcnemar_exact_test_on_a_hand_made_pairing():
    # 20 problems: both right on 2, only the model on 8, only the parent on 1, neither on 9
    parent = [True] * 2 + [False] * 8 + [True] + [False] * 9
    model = [True] * 2 + [True] * 8 + [False] + [False] * 9
    test = significance.mcnemar(parent, model)
    # two-sided binomial over the 9 discordant problems: P(X <= 1) + P(X >= 8) = 2 * (1 + 9) / 2**9
    assert (test["problems"], test["gained"], test["lost"]) == (20, 8, 1)
    assert test["p_value"] == pytest.approx(20 / 512)
    assert significance.mcnemar(model, parent)["p_value"] == pytest.approx(20 / 512)  # symmetric
    assert significance.mcnemar([True, False], [True, False])["p_value"] == 1.0  # no discordant pair
    with pytest.raises(ValueError, match="same problems"):
        significance.mcnemar([True], [True, False])


def test_paired_comparison_matches_problems_by_id_and_reports_each_reading():
    formatted = _formatted(["1", "2", "3", "4"])
    params = EvaluateParams()
    _, parent = score("base", formatted, ["It is 1", "no idea", _gen("3"), "5"], params)
    # the tuned model's samples in another order: pairs are matched by id, not by position
    _, tuned = score("tuned", formatted, [_gen("1"), _gen("2"), "3", _gen("9")], params)
    test = evaluation.paired_comparison(parent, tuned.iloc[::-1].reset_index(drop=True))
    assert (test["answer_accuracy"]["gained"], test["answer_accuracy"]["lost"]) == (2, 1)  # q0, q1 / q2
    assert (test["lenient_accuracy"]["gained"], test["lenient_accuracy"]["lost"]) == (1, 0)  # q1 / -
    assert (test["format_compliance"]["gained"], test["format_compliance"]["lost"]) == (3, 1)
    results = {"base": {}, "tuned": {}}
    evaluation.with_paired(results, {"base": parent, "tuned": tuned}, "base", "tuned")
    assert results["tuned"]["paired"]["against"] == "base" and "paired" not in results["base"]


def test_score_table_gives_each_reading_its_interval_and_the_paired_test():
    formatted = _formatted(["1", "2", "3", "4"])
    results, samples = {}, {}
    for label, texts in (("base", ["1", "x", "x", "x"]), ("tuned", [_gen("1"), _gen("2"), _gen("3"), "x"])):
        results[label], samples[label] = score(label, formatted, texts, EvaluateParams())
    evaluation.with_paired(results, samples, "base", "tuned")
    table = evaluation.score_table(results)
    assert "| base | 4 | 0.000 [0.000, 0.490] | 0.250 [0.046, 0.699] | 0.000 [0.000, 0.490] |" in table
    assert "| tuned vs base | +3 / −0, p = 0.25 | +2 / −0, p = 0.5 | +3 / −0, p = 0.25 |" in table
    assert results["tuned"]["lenient_accuracy_ci95"]["low"] == pytest.approx(0.3006, abs=1e-4)


def test_models_are_scored_on_the_test_split_when_there_is_one():
    rows = _formatted(["1", "2", "3", "4"]).assign(split=["dev", "test", "dev", "test"])
    assert generation.scored_split(rows)["id"].tolist() == ["q1", "q3"]
    assert generation.scored_split(rows.assign(split="dev"))["id"].tolist() == ["q0", "q1", "q2", "q3"]
    assert generation.scored_split(rows.drop(columns="split"))["id"].tolist() == ["q0", "q1", "q2", "q3"]


# ---------------------------------------------------------------- score
def test_score_one_sample_per_prompt():
    params = EvaluateParams(max_new_tokens=10)
    generated = [_gen("7") + "<end_of_turn>", _gen("8.0"), _gen("5", closed=False), "no tags at all"]
    metrics, samples = score("tuned", _formatted(["7", "8", "5", "6"]), generated, params, [5, 6, 10, 3],
                             repeated=[False, False, False, True])
    assert metrics["prompts"] == metrics["samples"] == 4
    assert metrics["answer_accuracy"] == 0.5  # 7, 8.0
    assert metrics["answer_exact"] == 0.25  # only 7
    assert metrics["format_compliance"] == 0.5
    assert metrics["missing_answer"] == 0.5  # unclosed, no tags
    assert metrics["truncated"] == 0.25  # 10 tokens = max_new_tokens
    assert metrics["mean_completion_tokens"] == 6.0
    assert metrics["repeated"] == 0.25 and samples["repeated"].tolist() == [False, False, False, True]  # a loop cut
    assert "pass@1" not in metrics
    assert samples["generated"][0] == _gen("7")  # end-of-turn removed
    assert samples["reference"].map(type).eq(str).all() and list(samples.columns) == evaluation.SAMPLE_COLUMNS


def test_score_several_samples_gives_pass_and_majority_at_k():
    params = EvaluateParams(num_samples=3, temperature=1.0)
    generated = [
        _gen("1"), _gen("2"), _gen("2"),  # q0 (ref 2): 2 of 3 right, majority 2 -> right
        _gen("9"), _gen("3"), _gen("9"),  # q1 (ref 3): 1 of 3 right, majority 9 -> wrong
        "x", "y", _gen("4", closed=False),  # q2 (ref 4): none right, no answer to vote
    ]
    metrics, samples = score("m", _formatted(["2", "3", "4"]), generated, params)
    assert metrics["samples"] == 9 and metrics["prompts"] == 3
    assert metrics["answer_accuracy"] == pytest.approx(3 / 9)  # pass@1 over all samples
    assert metrics["pass@3"] == pytest.approx(2 / 3)
    assert metrics["majority@3"] == pytest.approx(1 / 3)
    assert metrics["truncated"] is None and metrics["mean_completion_tokens"] is None  # no token counts given
    assert samples["sample"].tolist() == [0, 1, 2] * 3


def test_score_with_nothing_generated_is_counted_not_a_crash():
    metrics, samples = score("m", _formatted([]), [], EvaluateParams())
    assert metrics["prompts"] == 0 and metrics["answer_accuracy"] is None and samples.empty
    with pytest.raises(ValueError, match="2 generations for 1 prompts x 1 samples"):
        score("m", _formatted(["1"]), ["a", "b"], EvaluateParams())


def _mixed(answers, open_ended):
    """Rows with an answer to match and open-ended ones (their answer: the reference, or "" for a prompt only)."""
    formatted = _formatted(answers)
    formatted["open_ended"] = open_ended
    return formatted


def test_answer_metrics_leave_open_ended_rows_out_and_count_them():
    params = EvaluateParams(num_samples=2, temperature=1.0)
    formatted = _mixed(["2", "Rain on the roof.", "3", ""], [False, True, False, True])
    generated = [
        _gen("2"), _gen("5"),  # q0 (ref 2): 1 of 2 right
        _gen("A poem."), "no tags",  # q1, open-ended: never right or wrong
        _gen("3"), _gen("3"),  # q2 (ref 3): 2 of 2 right
        _gen("A limerick."), _gen("Another."),  # q3, open-ended, prompt only
    ]
    metrics, samples = score("m", formatted, generated, params)
    assert (metrics["prompts"], metrics["open_ended_prompts"], metrics["samples"]) == (4, 2, 8)
    assert metrics["answer_accuracy"] == metrics["answer_exact"] == pytest.approx(3 / 4)  # over q0 and q2 only
    assert metrics["missing_answer"] == 0.0  # q1's "no tags" is not an answer that went missing
    assert metrics["pass@2"] == metrics["majority@2"] == 1.0  # q0's vote: a tie, the first drawn (2) wins
    assert metrics["format_compliance"] == pytest.approx(7 / 8)  # the format holds for every row
    assert "judge_score" not in metrics and samples["judge_score"].isna().all()
    assert samples["open_ended"].tolist() == [False, False, True, True, False, False, True, True]
    assert samples.loc[samples["open_ended"], "correct"].isna().all()
    assert samples.loc[~samples["open_ended"], "correct"].tolist() == [True, False, True, True]


def test_only_open_ended_rows_give_no_answer_metrics_and_the_report_says_why():
    metrics, _ = score("m", _mixed(["", "ref"], [True, True]), [_gen("a"), "b"], EvaluateParams())
    assert metrics["open_ended_prompts"] == 2 and metrics["format_compliance"] == 0.5
    assert metrics["answer_accuracy"] is metrics["answer_exact"] is metrics["missing_answer"] is None
    note = evaluation.open_ended_note({"base": metrics, "tuned": metrics})
    assert "2 of the 2 prompts are open-ended" in note and "set `evaluate.judge`" in note
    assert evaluation.open_ended_note({"tuned": score("m", _formatted(["1"]), [_gen("1")], EvaluateParams())[0]}) == ""


class _Judged:  # what `judge.Judge.score` returns
    def __init__(self, values, malformed=0, seconds=0.5):
        self.values, self.malformed, self.seconds = np.asarray(values), malformed, seconds


def test_judge_scores_are_averaged_over_all_samples_and_over_the_open_ended_ones():
    formatted = _mixed(["7", "A haiku.", ""], [False, True, True])
    generated = [_gen("7"), _gen("Rain."), _gen("Snow.")]
    metrics, samples = score("m", formatted, generated, EvaluateParams(), judged=_Judged([1.0, 0.5, 0.0], 1))
    assert metrics["judge_score"] == pytest.approx(0.5) and metrics["judge_score_open_ended"] == pytest.approx(0.25)
    assert (metrics["judge_malformed"], metrics["judge_seconds"]) == (1, 0.5)
    assert samples["judge_score"].tolist() == [1.0, 0.5, 0.0] and metrics["answer_accuracy"] == 1.0
    table = markdown_table({"tuned": metrics})
    assert "| judge_score | 0.5 |" in table and "| judge_malformed | 1 |" in table
    # one kind of row only: the mean over all is the mean over them
    only_open, _ = score("m", formatted.iloc[1:], generated[1:], EvaluateParams(), judged=_Judged([0.5, 0.0]))
    assert only_open["judge_score"] == 0.25 and "judge_score_open_ended" not in only_open


def test_the_judge_is_asked_about_each_sample_with_its_reference_or_none():
    asked = {}

    class Judge:
        def score(self, prompts, completions, references):
            asked.update(prompts=prompts, completions=completions, references=references)
            return _Judged([0.0] * len(completions))

    formatted = _mixed(["7", ""], [False, True])
    evaluation.judge_generations(Judge(), formatted, [_gen("7") + "<end_of_turn>", "x", "y", "z"], 2)
    assert asked["prompts"] == [formatted["prompt"][0]] * 2 + [formatted["prompt"][1]] * 2
    assert asked["completions"] == [_gen("7"), "x", "y", "z"]  # as scored: end of turn removed
    assert asked["references"] == ["7", "7", None, None]


def test_markdown_table_side_by_side_with_delta_and_gaps():
    table = markdown_table(
        {"base": {"eval_loss": 2.0, "pass@2": None, "label": "x"}, "tuned": {"eval_loss": 0.5, "pass@2": 0.75}},
        delta=("base", "tuned"),
    )
    lines = table.splitlines()
    assert lines[0] == "| metric | base | tuned | tuned − base |"
    assert "| eval_loss | 2 | 0.5 | -1.5 |" in lines
    assert "| pass@2 | — | 0.75 | — |" in lines
    assert "label" not in table  # only numbers


def test_sampling_settings_are_validated():
    with pytest.raises(ValidationError, match="num_samples > 1 needs temperature > 0"):
        EvaluateParams(num_samples=4)
    with pytest.raises(ValidationError, match="top_p / top_k need temperature > 0"):
        EvaluateParams(top_k=5)
    EvaluateParams(num_samples=4, temperature=0.8, top_p=0.9, top_k=20)


def test_training_curves_figure():
    sft = [{"step": i, "loss": 5.0 / i} for i in range(1, 6)]
    assert len(evaluation.training_curves({"sft": sft}).axes) == 1
    grpo = [{"step": 1, "reward": 1.0, "kl": 0.0}, {"step": 2, "reward": 1.5, "kl": 0.01}]
    fig = evaluation.training_curves({"sft": sft, "preference": None, "grpo": grpo})
    assert len(fig.axes) == 3 and [ax.get_title() for ax in fig.axes[:2]] == ["SFT", "GRPO"]  # + the KL twin
    pairs = [{"step": 1, "loss": 0.7, "rewards/margin": 0.1, "rewards/accuracy": 0.6}]
    fig = evaluation.training_curves({"sft": sft, "preference": pairs}, titles={"preference": "DPO"})
    assert [ax.get_title() for ax in fig.axes] == ["SFT", "DPO"]
    assert len(evaluation.training_curves({"sft": None}).axes) == 1


def test_empty_eval_split_gives_a_report_not_a_crash():
    from tunix_pipeline.evaluate.policies import evaluate_models

    empty = pd.DataFrame(columns=["id", "prompt", "answer"])
    sft_result = {"history": [{"step": 1, "loss": 2.0}], "checkpoint_dir": "nowhere"}
    metrics, samples, report, curve = evaluate_models(
        empty, empty, empty, {"path": "nowhere"}, sft_result, ModelParams(), EvaluateParams(), MESH
    )
    assert metrics == {"empty_eval_split": True} and samples.empty
    assert "eval split is empty" in report and curve is not None


# ---------------------------------------------------------------- generation on the tiny model
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from tunix_pipeline.models import load_model
    from tunix_pipeline.core.runtime import make_mesh

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    return model, mesh


def test_prompt_lengths_count_like_the_sampler(tokenizer):
    prompts = ["<bos><start_of_turn>user\nAda has 3 apples.<end_of_turn>\n<start_of_turn>model\n", "hello"]
    lengths = generation.prompt_lengths(tokenizer, prompts)
    from tunix.generate import sampler as sampler_lib

    sampler = object.__new__(sampler_lib.Sampler)  # only its tokenize(), which needs the tokenizer
    from tunix.generate import tokenizer_adapter

    sampler.tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
    assert lengths == [len(sampler.tokenize(p)) for p in prompts]


@pytest.mark.slow
def test_generation_batches_reuse_one_sampler_and_see_new_weights(tiny, tokenizer):
    import jax
    from flax import nnx

    model, mesh = tiny
    prompts = [f"<bos><start_of_turn>user\nAda has {i} apples.<end_of_turn>\n<start_of_turn>model\n" for i in range(5)]
    params = EvaluateParams(max_new_tokens=6, batch_size=4)
    generator = generation.Generator(model, tokenizer, params, prompt_length=32)
    with mesh:
        texts, lengths = generator(prompts)  # 5 prompts: a full batch of 4, then 1 padded to 4
        again, _ = generator(prompts[:1])
        assert len(texts) == len(lengths) == 5 and again[0] == texts[0]  # greedy: the same text
        assert all(0 <= n <= 6 for n in lengths)

        # new weights in the same model: the next call generates with them, like a fresh sampler
        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x * 1.5, state))
        reused, _ = generator(prompts[:4])
        fresh, _ = generation.Generator(model, tokenizer, params, prompt_length=32)(prompts[:4])
        nnx.update(model, state)
    assert reused == fresh


def test_sampled_generation_draws_several_samples_per_prompt(tiny, tokenizer):
    model, mesh = tiny
    prompts = [f"<bos><start_of_turn>user\nq{i}<end_of_turn>\n<start_of_turn>model\n" for i in range(2)]
    params = EvaluateParams(max_new_tokens=8, batch_size=8, num_samples=4, temperature=1.0, top_k=50)
    with mesh:
        texts, lengths = generation.Generator(model, tokenizer, params, prompt_length=16)(prompts)
    assert len(texts) == 8
    assert len(set(texts[:4])) > 1  # a random model sampled at temperature 1 does not repeat itself


def test_our_prefill_generates_what_tunixs_does_and_shares_one_prefill_per_group(tiny, tokenizer):
    """Our sampler (the last position's logits only; one prefill per group of identical prompts) greedily
    generates the tokens Tunix's own sampler does, grouped or not; a batch that is not made of groups takes
    the ungrouped prefill, and sampled groups still draw different completions."""
    from tunix.generate import sampler as sampler_lib

    model, mesh = tiny
    prompts = [f"<bos><start_of_turn>user\nAda has {i} pears.<end_of_turn>\n<start_of_turn>model\n" for i in range(2)]
    grouped = [p for p in prompts for _ in range(4)]
    args = dict(max_generation_steps=8, max_prompt_length=32, eos_tokens=generation.end_tokens(tokenizer))
    cfg = model.config
    tunix = sampler_lib.Sampler(model, tokenizer, sampler_lib.CacheConfig(
        cache_size=40, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    ours = generation.make_sampler(model, tokenizer, 40, group_size=4)
    with mesh:
        expected = [t.tolist() for t in tunix(grouped, **args).tokens]
        assert [t.tolist() for t in ours(grouped, **args).tokens] == expected
        assert ours._compiled_prefill_fn is ours._prefills[4]
        assert [t.tolist() for t in ours(grouped[3:] + grouped[:3], **args).tokens] == expected[3:] + expected[:3]
        assert ours._compiled_prefill_fn is ours._prefills[1]  # not groups of 4: one prefill per row
        sampled = ours(grouped, **args, temperature=1.0, top_p=1.0, seed=0).tokens
    assert len({tuple(t.tolist()) for t in sampled[:4]}) > 1
    assert upstream.in_groups([[1, 2]] * 4 + [[3]] * 4, 4) and not upstream.in_groups([[1, 2]] * 3 + [[3]] * 5, 4)


def test_inverse_cdf_sampling_draws_from_the_softmax():
    """The sampler's full-vocabulary draw follows softmax(logits) as closely as `jax.random.categorical` does
    (total variation over 40,000 draws), never picks a word whose logit is -inf, and repeats itself for a key."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((2, 1000)) * 2, jnp.float32).at[:, 7].set(-jnp.inf)
    keys = jax.random.split(jax.random.PRNGKey(0), 40_000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling.sample_inverse_cdf(k, logits, blocks=16)))(keys))
    reference = np.asarray(jax.jit(jax.vmap(lambda k: jax.random.categorical(k, logits)))(keys))
    expected = np.asarray(jax.nn.softmax(logits))
    for row in range(2):
        tv = [0.5 * np.abs(np.bincount(d[:, row], minlength=1000) / len(keys) - expected[row]).sum()
              for d in (draws, reference)]
        assert tv[0] < 1.3 * tv[1] + 0.005, tv
        assert not (draws[:, row] == 7).any()
    key = jax.random.PRNGKey(1)
    assert (sampling.sample_inverse_cdf(key, logits) == sampling.sample_inverse_cdf(key, logits)).all()


def test_evaluator_skips_and_counts_prompts_that_do_not_fit(tiny, tokenizer):
    model, mesh = tiny
    formatted = _formatted(["1", "2", "3"])
    formatted.loc[1, "prompt"] = formatted.loc[1, "prompt"] + " word" * 80  # far too long
    params = EvaluateParams(max_new_tokens=4, batch_size=4, max_prompt_length=32)
    evaluator = evaluation.Evaluator(model, tokenizer, mesh, params, pd.DataFrame(), formatted, loss_batch_size=4)
    metrics, samples = evaluator.measure("base")
    assert metrics["prompts_too_long"] == 1 and metrics["prompts"] == 2
    assert set(samples["id"]) == {"q0", "q2"}
    assert metrics["eval_loss"] is None  # no tokenized eval rows: no loss, no crash
    assert not math.isnan(metrics["format_compliance"])

    # without a limit the cache grows to fit the longest prompt
    held_out, skipped, length = generation.select_prompts(formatted, tokenizer, EvaluateParams())
    assert skipped == 0 and len(held_out) == 3 and length >= max(generation.prompt_lengths(tokenizer, formatted["prompt"].tolist()))
    assert length == 1 << (length - 1).bit_length()  # a power of two
    np.testing.assert_array_equal(held_out["id"], ["q0", "q1", "q2"])


@pytest.mark.slow
def test_rows_scored_before_are_taken_for_the_same_policy_and_prompts_only(tiny, tokenizer, tmp_path):
    """A later evaluation takes a policy's generations from the one that scored them where both name the same
    policy and settings (`scored_by`) on the same prompts: what it would have generated again, as here."""
    model, mesh = tiny
    # rows kept as they end (`generations_dir`) would be taken too: off, so that `earlier` alone is what is taken
    formatted = _formatted(["1", "2", "3"])
    params = EvaluateParams(max_new_tokens=6, batch_size=4, generations_dir=None)

    def evaluator(prompts=formatted):
        return evaluation.Evaluator(model, tokenizer, mesh, params, pd.DataFrame(), prompts, loss_batch_size=4)

    first, rows = evaluator().measure("tuned", "policy-a")
    assert rows["scored_by"].eq("policy-a").all()
    path = tmp_path / "eval_samples.jsonl"  # through JSON lines, as the catalog hands `eval_samples` on
    rows.to_json(path, lines=True, orient="records", force_ascii=False)
    earlier = pd.read_json(path, lines=True, orient="records", dtype=False)

    later = evaluator()
    metrics, taken = later.measure("sft", "policy-a", earlier)
    assert later._generator is None  # nothing generated
    assert metrics.pop("generations_reused") and metrics == first
    assert taken["model"].eq("sft").all() and taken.drop(columns="model").equals(rows.drop(columns="model"))
    # another policy (or settings), or other prompts: generated, and greedy decoding writes the same texts again
    for digest, prompts in (("policy-b", formatted), ("policy-a", formatted.head(2))):
        again = evaluator(prompts)
        metrics, generated = again.measure("sft", digest, earlier)
        assert again._generator is not None and "generations_reused" not in metrics
        assert generated["generated"].tolist() == rows["generated"].head(len(prompts)).tolist()
    # a file without the columns to tell (older, or edited by hand): generated, not a KeyError
    again = evaluator()
    metrics, _ = again.measure("sft", "policy-a", earlier.drop(columns=["prompt"]))
    assert again._generator is not None and "generations_reused" not in metrics


@pytest.mark.slow
def test_an_evaluation_stopped_part_way_generates_only_the_rows_it_had_not(tiny, tokenizer, tmp_path):
    """Each greedy row is written to `evaluate.generations_dir` as it ends; a run stopped part-way (here: the file as
    a kill leaves it, the first rows whole and the last cut mid-line) takes those on the next run, generates the
    rest only, and scores what an uninterrupted run scores."""
    model, mesh = tiny
    formatted = _formatted([str(i) for i in range(10)])
    kept = tmp_path / "generations"
    params = EvaluateParams(max_new_tokens=6, batch_size=4, generations_dir=str(kept))

    def evaluator(settings=params):
        return evaluation.Evaluator(model, tokenizer, mesh, settings, pd.DataFrame(), formatted, loss_batch_size=4)

    whole, rows = evaluator().measure("tuned", "policy-a")
    lines = (kept / "policy-a.jsonl").read_text().splitlines()
    assert len(lines) == 10 and "generations_resumed" not in whole
    by_key = {json.loads(line)["prompt"]: json.loads(line)["tokens"] for line in lines}
    keys = [generation.prompt_key(p) for p in formatted["prompt"]]
    assert [len(by_key[k]) for k in keys] == rows["completion_tokens"].tolist()  # every prompt's row, whole

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "policy-a.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    again = evaluator(params.model_copy(update={"generations_dir": str(stopped)}))
    metrics, resumed = again.measure("tuned", "policy-a")
    assert metrics.pop("generations_resumed") == 4 and metrics == whole
    assert resumed.equals(rows)
    written = (stopped / "policy-a.jsonl").read_text().splitlines()
    assert len(written) == 11 and sorted(written[:4] + written[5:]) == sorted(lines)  # the cut line stays unread

    # sampled decoding, or no digest of the policy: nothing kept
    for settings, digest in ((params.model_copy(update={"temperature": 1.0}), "policy-b"), (params, None)):
        evaluator(settings).measure("tuned", digest)
    assert sorted(p.name for p in kept.iterdir()) == ["policy-a.jsonl"]


def test_kept_rows_that_are_not_rows_are_generated_again(tmp_path):
    """A kept file edited by hand or cut by a kill: only whole rows of token ids are taken, and the next row written
    starts a line of its own."""
    kept = generation.KeptRows(tmp_path / "rows.jsonl")
    key = generation.prompt_key
    lines = [{"prompt": key("a"), "tokens": [5, 6]}, {"prompt": key("b"), "tokens": ["5", 6]},
             {"prompt": key("c"), "tokens": 7}, {"prompt": key("d"), "tokens": [1.5]}, ["e"], {"tokens": [1]}]
    kept.path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"prompt": "' + key("f"))
    taken = kept.taken(["a", "b", "c", "d", "e", "f"])
    assert taken[0].tolist() == [5, 6] and taken[1:] == [None] * 5
    kept.write("b", np.array([8]))
    assert json.loads(kept.path.read_text().splitlines()[-1]) == {"prompt": key("b"), "tokens": [8]}
    assert [r.tolist() for r in kept.taken(["a", "b"])] == [[5, 6], [8]]


def test_scored_by_names_the_checkpoint_as_committed_and_every_setting(tmp_path):
    import orbax.checkpoint as ocp

    from tunix_pipeline.evaluate.policies import scored_by

    def save(step):  # a checkpoint as Orbax commits it
        with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.save(step, args=ocp.args.StandardSave({"w": np.zeros(2)}), force=True)

    save(5)
    base, model, params, runtime = {"path": "base"}, ModelParams(), EvaluateParams(), RuntimeParams()
    digest = scored_by(base, str(tmp_path / "ckpt"), 5, model, params, runtime)
    assert digest == scored_by(base, tmp_path / "ckpt", 5, model, params, runtime)  # a folder however written
    # where the rows are kept changes no row
    assert digest == scored_by(base, tmp_path / "ckpt", 5, model, EvaluateParams(generations_dir=str(tmp_path)), runtime)
    others = [scored_by({"path": "other"}, tmp_path / "ckpt", 5, model, params, runtime),
              scored_by(base, tmp_path / "ckpt", 5, model, EvaluateParams(max_new_tokens=7), runtime),
              scored_by(base, None, None, model, params, runtime)]
    assert digest not in others and None not in others
    assert scored_by(base, tmp_path / "ckpt", 6, model, params, runtime) is None  # no such committed step
    shutil.rmtree(tmp_path / "ckpt")
    save(5)  # trained again to the same step: another checkpoint
    assert scored_by(base, tmp_path / "ckpt", 5, model, params, runtime) != digest


def test_eval_loss_covers_the_first_loss_rows_only(tiny, tokenizer):
    from tunix_pipeline.config import TokenizeParams
    from tunix_pipeline.data.tokenization import tokenize_split
    from tunix_pipeline.evaluate.evaluation import evaluate_loss

    model, mesh = tiny
    formatted = _formatted([str(i) for i in range(6)])
    formatted["completion"] = [_gen(a) + "<end_of_turn>" for a in formatted["answer"]]
    rows = tokenize_split(formatted, tokenizer, TokenizeParams(max_length=48))[0]
    evaluator = evaluation.Evaluator(model, tokenizer, mesh, EvaluateParams(num_prompts=0, loss_rows=2), rows, formatted,
                                     loss_batch_size=8)
    metrics, _ = evaluator.measure("base")
    first_two = evaluate_loss(model, rows.head(2), 8, mesh)
    assert metrics["eval_tokens"] == first_two["tokens"] < evaluate_loss(model, rows, 8, mesh)["tokens"]
    assert metrics["eval_loss"] == first_two["loss"]


def test_evaluation_with_the_judge_model_reports_its_score_beside_accuracy(tiny, tokenizer, tiny_model_dir):
    judge_lib = pytest.importorskip("tunix_pipeline.train.judge")
    from tunix_pipeline.config import JudgeParams
    from tunix_pipeline.evaluate.policies import _judge

    model, mesh = tiny
    params = EvaluateParams(max_new_tokens=4, batch_size=4, judge=JudgeParams(source=str(tiny_model_dir), batch_size=4))
    judge = _judge(params, mesh)
    assert isinstance(judge, judge_lib.Judge) and _judge(EvaluateParams(), mesh) is None
    formatted = _mixed(["1", "A haiku about rain.", "3", ""], [False, True, False, True])
    evaluator = evaluation.Evaluator(model, tokenizer, mesh, params, pd.DataFrame(), formatted, 4, judge)
    metrics, samples = evaluator.measure("tuned")
    assert 0.0 <= metrics["judge_score"] <= 1.0 and 0.0 <= metrics["judge_score_open_ended"] <= 1.0
    assert 0 <= metrics["judge_malformed"] <= 4 and metrics["judge_seconds"] > 0
    assert samples["judge_score"].between(0, 1).all() and metrics["open_ended_prompts"] == 2


def test_gathered_weights_generate_the_same_tokens_and_leave_the_model_sharded(tiny, tokenizer):
    """`runtime.decode_weights: gathered`: each call decodes with the weights whole on every data-parallel device (no
    collective a token), the same greedy tokens as over the fsdp-sharded weights; the model itself stays sharded."""
    import jax
    from flax import nnx

    from tunix_pipeline.core.runtime import split_over_batch

    model, mesh = tiny
    split = [x for x in jax.tree.leaves(nnx.state(model)) if split_over_batch(x)]
    assert split and generation.gathers_weights("gathered", model) and not generation.gathers_weights("sharded", model)
    assert generation.Generator(model, tokenizer, EvaluateParams(), 16, "gathered").sampler.gather_weights
    prompts = [f"<bos><start_of_turn>user\nBo has {i} figs.<end_of_turn>\n<start_of_turn>model\n" for i in range(4)]
    args = dict(max_generation_steps=8, max_prompt_length=32, eos_tokens=generation.end_tokens(tokenizer))
    sharded = generation.make_sampler(model, tokenizer, 40)
    gathered = generation.make_sampler(model, tokenizer, 40, gather_weights=True)
    read = []
    decode = gathered._compiled_decode_fn
    gathered._compiled_decode_fn = lambda params, state: read.append(params) or decode(params, state)
    with mesh:
        expected = [t.tolist() for t in sharded(prompts, **args).tokens]
        assert [t.tolist() for t in gathered(prompts, **args).tokens] == expected
    assert read and not any(split_over_batch(x) for x in jax.tree.leaves(read[0]))
    assert len([x for x in jax.tree.leaves(nnx.state(model)) if split_over_batch(x)]) == len(split)  # read afresh
    assert gathered._flattened_transformer_state is not read[0]  # the call's copy is dropped after it
