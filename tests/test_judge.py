"""The judge reward on the tiny model: its label scores are the model's own next-token probabilities, numbers are
read or counted as malformed, batches of any size give the same scores, and GRPO logs the judge's time."""

import jax
import numpy as np
import pandas as pd
import pytest

from tunix_pipeline.config import GrpoParams, JudgeParams, RewardParams, RuntimeParams
from tunix_pipeline.train import judge as judge_lib
from tunix_pipeline.train.rewards import RewardSet

PROMPTS = [f"<bos><start_of_turn>user\nAda has {i} apples. How many?<end_of_turn>\n<start_of_turn>model\n"
           for i in range(5)]
COMPLETIONS = [f"<reasoning>She has {i}.</reasoning><answer>{i}</answer><end_of_turn>" for i in range(5)]
REFERENCES = [f"<reasoning>{i}</reasoning><answer>{i}</answer>" for i in range(4)] + [None]


def _judge(tiny_model_dir, mesh=None, **kwargs):
    return judge_lib.Judge(JudgeParams(source=str(tiny_model_dir), **kwargs), mesh)


def test_label_scores_are_the_models_next_token_probabilities(tiny_model_dir):
    """The prefill-only path (left-padded, bucketed, batched with padding) against one plain forward pass per
    rubric: P(label words) renormalised, weighted by the label scores."""
    from tunix_pipeline.models.loading import compute_logits, load_model

    judge = _judge(tiny_model_dir, batch_size=2, labels={"Yes": 1.0, "No": 0.0, "Maybe": 0.5})
    scores = judge.score(PROMPTS, COMPLETIONS, REFERENCES)
    assert scores.malformed == 0 and 0 < scores.label_mass <= 1 and scores.seconds > 0

    model, _ = load_model(tiny_model_dir, None, "float32")
    expected = []
    for row in zip(PROMPTS, COMPLETIONS, REFERENCES):
        ids = np.asarray(judge.sampler.tokenize(judge.render(*row)))
        probs = np.exp(jax.nn.log_softmax(compute_logits(model, ids[None], np.ones_like(ids)[None])[0, -1]))
        per_label = np.array([probs[t].sum() for t in judge.labels])
        expected.append(per_label @ np.array([1.0, 0.0, 0.5]) / per_label.sum())
    np.testing.assert_allclose(scores.values, expected, rtol=1e-4, atol=1e-6)
    # the batch's size and its padding rows change nothing
    again = _judge(tiny_model_dir, batch_size=8, labels={"Yes": 1.0, "No": 0.0, "Maybe": 0.5}).score(
        PROMPTS[:3], COMPLETIONS[:3], REFERENCES[:3])
    np.testing.assert_allclose(again.values, scores.values[:3], rtol=1e-5)


def test_the_rubric_shows_the_question_the_completion_and_the_reference(tiny_model_dir):
    judge = _judge(tiny_model_dir)
    judge.load()
    text = judge.render(PROMPTS[2], COMPLETIONS[2], None)
    assert "Ada has 2 apples. How many?" in text and "<start_of_turn>user\nAda" not in text.split("Question:")[1]
    assert "<answer>2</answer>" in text and judge_lib.NO_REFERENCE in text and "<end_of_turn>\n<start_of" in text
    assert "<reasoning>1</reasoning>" in judge.render(PROMPTS[1], COMPLETIONS[1], REFERENCES[1])
    plain = _judge(tiny_model_dir, chat_template=False, rubric="Q: {prompt}\nA: {completion}\nRight (Yes or No)?")
    plain.load()
    assert plain.render(PROMPTS[2], COMPLETIONS[2], None) == (
        f"{plain.tokenizer.bos_token}Q: Ada has 2 apples. How many?\nA: <reasoning>She has 2.</reasoning>"
        "<answer>2</answer>\nRight (Yes or No)?")


def test_number_replies_are_read_and_malformed_ones_counted(tiny_model_dir):
    assert judge_lib.read_number(" 7/10, because", (0, 10)) == 0.7
    assert judge_lib.read_number("Score: -1", (0, 10)) is None  # outside the range
    assert judge_lib.read_number("no idea", (1, 5)) is None
    assert judge_lib.read_number("4.5", (1, 5)) == 0.875
    # the random tiny model replies with no number: every score is the malformed score, counted, no failure
    judge = _judge(tiny_model_dir, read="number", max_new_tokens=4, malformed_score=0.25, batch_size=4)
    scores = judge.score(PROMPTS, COMPLETIONS, REFERENCES)
    replies = judge.sampler([judge.render(*r) for r in zip(PROMPTS, COMPLETIONS, REFERENCES)][:4],
                            max_generation_steps=4, max_prompt_length=128).text
    readable = sum(judge_lib.read_number(r, (0, 10)) is not None for r in replies)
    assert scores.malformed >= 5 - readable - 1 and scores.label_mass is None
    # every malformed reply scores exactly the malformed score; read ones lie in [0, 1]
    assert np.count_nonzero(scores.values == 0.25) >= scores.malformed > 0
    assert ((scores.values >= 0) & (scores.values <= 1)).all()


def test_a_rubric_too_long_for_the_judge_scores_malformed(tiny_model_dir):
    judge = _judge(tiny_model_dir, max_prompt_length=256, malformed_score=0.5)
    long = "<reasoning>" + "many words here " * 200 + "</reasoning><answer>3</answer>"
    scores = judge.score(PROMPTS[:2], [COMPLETIONS[0], long], REFERENCES[:2])
    assert scores.malformed == 1 and scores.values[1] == 0.5 and scores.values[0] != 0.5


def test_labels_that_start_alike_are_refused(tokenizer):
    with pytest.raises(judge_lib.JudgeError, match="start with the same token"):
        judge_lib.label_token_ids(tokenizer, {"Yes": 1.0, "Yes indeed": 0.0})


def test_settings_are_checked_before_any_model_loads():
    with pytest.raises(ValueError, match="go together"):
        RewardParams(fn="judge")
    with pytest.raises(ValueError, match="for `fn: judge`"):
        RewardParams(fn="answer", judge={"source": "x"})
    with pytest.raises(ValueError, match="unknown"):
        JudgeParams(source="x", rubric="{question} {completion}")
    with pytest.raises(ValueError, match="must rise"):
        JudgeParams(source="x", read="number", score_range=(5, 1))


def test_a_judge_that_cannot_resolve_here_is_refused_before_any_model_loads(tmp_path):
    """The GRPO and preference nodes build their rewards before the policy loads: a judge folder that does not
    exist, or a PyPI model that is not installed, stops the run there with the key to fix."""
    from tunix_pipeline.core.errors import ModelError

    missing = RewardParams(fn="judge", weight=1.0, judge={"source": str(tmp_path / "no-such-judge")})
    with pytest.raises(ModelError, match="judge.source: model folder not found: .*no-such-judge"):
        RewardSet([RewardParams(fn="format_exact"), missing])
    with pytest.raises(ModelError, match="judge.source 'pypi:no-such-model-gguf': the package is not installed"):
        judge_lib.Judge(JudgeParams(source="pypi:no-such-model-gguf"))
    assert judge_lib.Judge(JudgeParams(source="google/gemma-3-4b-it")).sampler is None  # a hub id downloads later

    from tunix_pipeline.config import EvaluateParams
    from tunix_pipeline.evaluate.policies import _evaluator

    evaluate = EvaluateParams(judge={"source": str(tmp_path / "no-such-judge")})  # the policy's folder is missing too
    with pytest.raises(ModelError, match="judge.source"):
        _evaluator(None, None, {"path": str(tmp_path / "no-such-policy")}, {}, None, evaluate, RuntimeParams())


def test_a_judge_takes_the_last_devices_and_the_policy_the_rest():
    judge_params = {"source": "x", "devices": 2}
    rewards = [RewardParams(fn="answer"), RewardParams(fn="judge", judge=judge_params)]
    policy, judge_mesh = judge_lib.meshes(RuntimeParams(), rewards)
    devices = jax.devices()
    assert list(policy.devices.flat) == devices[:6] and list(judge_mesh.devices.flat) == devices[6:]
    assert judge_lib.meshes(RuntimeParams(), rewards[:1])[1] is None
    tensor_parallel = judge_lib.meshes(RuntimeParams(mesh={"data": 2, "fsdp": 2, "tp": 2}), rewards)[0]
    assert dict(tensor_parallel.shape) == {"data": 1, "fsdp": 3, "tp": 2}
    assert dict(judge_lib.meshes(RuntimeParams(mesh={"fsdp": 2, "tp": 4}), rewards)[0].shape)["tp"] == 1
    with pytest.raises(judge_lib.JudgeError, match="leaves the policy none"):
        judge_lib.meshes(RuntimeParams(), [RewardParams(fn="judge", judge={**judge_params, "devices": 8})])


@pytest.mark.slow
def test_grpo_with_a_judge_on_its_own_devices_logs_its_scores_and_time(tiny_model_dir, tokenizer, tmp_path):
    from tunix_pipeline.models import load_model
    from tunix_pipeline.train import grpo

    # two rows with an answer, two open-ended prompts with no reference (a judge's rows)
    formatted = pd.DataFrame({"id": [f"r{i}" for i in range(4)], "source": "t", "prompt": PROMPTS[:4],
                              "completion": COMPLETIONS[:2] + ["", ""], "answer": ["0", "1", "", ""],
                              "open_ended": [False, False, True, True]})
    rewards = [{"fn": "format_exact"}, {"fn": "answer"}, {"fn": "judge", "name": "rubric", "judge": {"source": str(tiny_model_dir),
                                                                                   "devices": 4, "batch_size": 4}}]
    params = GrpoParams(max_steps=2, batch_size=2, num_generations=2, max_prompt_length=32, max_completion_length=8,
                        learning_rate=1e-2, checkpoint_every=2, checkpoint_dir=str(tmp_path / "grpo"), rewards=rewards)
    mesh, judge_mesh = judge_lib.meshes(RuntimeParams(), params.rewards)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    set_ = RewardSet(params.rewards, judge_mesh)
    assert set_.fns[2].mesh is judge_mesh
    inputs = grpo.prepare(formatted, tokenizer, params, mesh, judge_mesh)
    result = grpo.train_grpo(model, tokenizer, inputs, params, mesh)
    assert result["latest_step"] == 2 and set(result["rewards"]) == {"format_exact", "answer", "rubric"}
    judged = [h["reward/rubric"] for h in result["history"]]
    assert all(0 <= r <= 1 for r in judged) and len(set(judged)) > 1  # the judge saw different completions
    assert all(h["judge/rubric/seconds"] > 0 and h["judge/rubric/malformed"] == 0 for h in result["history"])


@pytest.mark.slow
def test_preference_pairs_ranked_by_a_judge_sharing_the_policys_devices(tiny_model_dir, tokenizer, tmp_path):
    """`preference.from_rewards.rewards` with a judge: every sample judged once, pairs ordered by its score."""
    from tunix_pipeline.config import PreferenceParams
    from tunix_pipeline.models import load_model
    from tunix_pipeline.train import pairs

    formatted = pd.DataFrame({"id": [f"r{i}" for i in range(3)], "source": "t", "prompt": PROMPTS[:3],
                              "completion": COMPLETIONS[:3], "answer": [str(i) for i in range(3)]})
    spec = {"fn": "judge", "judge": {"source": str(tiny_model_dir), "batch_size": 4}}
    params = PreferenceParams(enabled=True, max_steps=1, max_prompt_length=32, max_response_length=32,
                              checkpoint_dir=str(tmp_path), from_rewards={"num_samples": 3, "max_new_tokens": 8,
                                                                          "margin": 0.0, "rewards": [spec]})
    mesh, judge_mesh = judge_lib.meshes(RuntimeParams(), params.from_rewards.rewards)
    assert judge_mesh is None  # no `devices`: the judge shares the policy's
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    rewards = RewardSet(params.from_rewards.rewards, mesh)
    out, counts = pairs.pairs_from_rewards(model, tokenizer, formatted, params, rewards, mesh, max_prompts=3)
    judge = rewards.fns[0]
    assert len(judge.last.values) == counts["samples"] == 9 and judge.last.malformed == 0
    assert counts["pairs"] == len(out) > 0 and (out["chosen_reward"] > out["rejected_reward"]).all()
