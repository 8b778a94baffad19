"""lm-evaluation-harness: our JAX backend against lm-eval's own Hugging Face backend on the same weights.

The tiny model is exported (our `export_pretrained`) and both backends read that folder: ours
through `load_pretrained`, lm-eval's `hf` through transformers on torch, both in float32.

Tolerances. A log-likelihood is a sum over the continuation's tokens of log-softmax values,
computed by both backends in float32. With these weights a token's log-probability is of
order 10 (the log-sum-exp over 576 logits of order 1-10), where one float32 ulp is ~1e-6;
the two programs round differently (XLA's fused reductions vs torch's kernels), about one
ulp per token, so a request of at most MAX_LENGTH = 48 tokens differs by at most ~5e-5:
it is held to 1e-4. A rolling log-likelihood is the sum of its windows, each such a request,
so it is held to 1e-4 per window. Greedy generation picks the argmax, so rounding can flip
a step only where the top two logits are within rounding of each other: texts must be
identical wherever every step's top-2 gap exceeds 1e-3, a thousand ulps of the logits.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from tunix_pipeline.config import EvaluateParams, FormatParams, HarnessParams, IngestParams, RuntimeParams, SourceParams  # noqa: E402
from tunix_pipeline.evaluate import evaluation, harness  # noqa: E402
from tunix_pipeline.core.errors import HarnessError  # noqa: E402

from .conftest import ROOT  # noqa: E402

MAX_LENGTH = 48  # short enough that long requests are cut on the left and rolling windows split


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """(our backend, lm-eval's hf backend, eval rows) over one exported tiny model."""
    from lm_eval.models.huggingface import HFLM

    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest
    from tunix_pipeline.models import export_pretrained, load_pretrained
    from tunix_pipeline.core.runtime import make_mesh

    folder = tmp_path_factory.mktemp("harness")
    varied = _redrawn(tiny_model_dir, folder / "varied")
    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    model, tokenizer = load_pretrained(varied, mesh)
    exported = folder / "exported"
    export_pretrained(model, exported, tokenizer=tokenizer)
    model, tokenizer = load_pretrained(exported, mesh)
    params = HarnessParams(enabled=True, batch_size=4, max_length=MAX_LENGTH)
    ours = harness.make_lm(model, tokenizer, mesh, params, exported)
    reference = HFLM(pretrained=str(exported), dtype="float32", device="cpu", batch_size=1, max_length=MAX_LENGTH)
    _, eval_records, _ = ingest(
        IngestParams(sources=[SourceParams(name="gsm", path=str(ROOT / "data/01_raw/arith_gsm8k.jsonl"), format="gsm8k")])
    )
    formatted = format_records(eval_records, tokenizer, FormatParams())
    return ours, reference, formatted


def _redrawn(model_dir, out):
    """The tiny model with its matrices redrawn at std 0.3: at the default init's 0.02 greedy decoding
    repeats one token whatever the prompt, which would make the generation comparison say little."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    rng = np.random.default_rng(0)
    weights = {k: v if "norm" in k else rng.normal(0, 0.3, v.shape).astype(v.dtype) for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihoods_match_lm_eval_hf_backend(setup):
    ours, reference, formatted = setup
    rows = formatted.head(6)
    bos = reference.tokenizer.bos_token
    pairs = [(p.removeprefix(bos), c) for p, c in zip(rows["prompt"], rows["completion"])]  # some cut on the left
    pairs += [("", c) for c in rows["completion"][:2]]  # empty context: BOS alone
    pairs += [("Ben has 3 apples. ", "How many?"), (bos + "Gus has", " 4 pears")]  # trailing space; BOS given
    mine = ours.loglikelihood(_requests("loglikelihood", pairs))
    theirs = reference.loglikelihood(_requests("loglikelihood", pairs))
    np.testing.assert_allclose([m[0] for m in mine], [t[0] for t in theirs], rtol=0, atol=1e-4)
    assert [m[1] for m in mine] == [t[1] for t in theirs]

    from lm_eval.utils import get_rolling_token_windows

    texts = [(p + c,) for p, c in pairs[:4]] + [("5 + 3 = 8",)]  # two windows of MAX_LENGTH each, and one
    windows = [len(list(get_rolling_token_windows(ours.tok_encode(t), ours.prefix_token_id, MAX_LENGTH, 1))) for (t,) in texts]
    assert max(windows) > 1
    mine = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    theirs = reference.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    assert np.all(np.abs(np.subtract(mine, theirs)) <= 1e-4 * np.array(windows)), (mine, theirs, windows)


def _top2_gaps(reference, prompt: str, steps: int) -> np.ndarray:
    """The top-2 logit gap at each step of transformers' own greedy decoding of `prompt`."""
    import torch

    ids = torch.tensor([reference.tok_encode(prompt)])
    with torch.no_grad():
        out = reference.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    top = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).numpy()


def test_greedy_generations_match_lm_eval_hf_backend(setup):
    ours, reference, formatted = setup
    steps = 12
    prompts = [p.removeprefix(reference.tokenizer.bos_token)[-60:] for p in formatted["prompt"].head(8)]
    gen = {"until": ["</answer>"], "do_sample": False, "max_gen_toks": steps}
    mine = ours.generate_until(_requests("generate_until", [(p, gen) for p in prompts]))
    theirs = reference.generate_until(_requests("generate_until", [(p, gen) for p in prompts]))
    decisive = [i for i, p in enumerate(prompts) if _top2_gaps(reference, p, steps).min() > 1e-3]
    assert len(decisive) >= len(prompts) // 2, "too few prompts with clear greedy choices to compare"
    assert [mine[i] for i in decisive] == [theirs[i] for i in decisive]
    assert len(set(mine)) > 1, "every prompt got the same text: the comparison says little"


def test_tagged_answer_prompts_generate_what_our_evaluation_generates(setup, tmp_path):
    """The task's rows (BOS text dropped, the tokenizer adding the token) give the model the very prompts
    our own evaluation gives it: the same greedy texts, up to the special tokens `hf` decodes away."""
    from tunix_pipeline.config import EvaluateParams
    from tunix_pipeline.generate.generation import Generator, select_prompts

    ours, _, formatted = setup
    steps = 8  # the prompts are 38-40 tokens: with 8 new ones they fit MAX_LENGTH uncut
    params = EvaluateParams(num_prompts=8, max_new_tokens=steps, batch_size=4)
    held_out, _, prompt_length = select_prompts(formatted, ours.tokenizer, params)
    expected, _ = Generator(ours.model, ours.tokenizer, params, prompt_length)(held_out["prompt"].tolist())
    rows = [json.loads(line) for line in harness.write_rows(held_out, ours.tokenizer, tmp_path / "rows.jsonl").open()]
    gen = {"until": ["<end_of_turn>"], "do_sample": False, "max_gen_toks": steps}
    got = ours.generate_until(_requests("generate_until", [(r["prompt"], gen) for r in rows]))
    assert max(len(ours.tok_encode(r["prompt"])) for r in rows) + steps <= MAX_LENGTH
    special = ours.tokenizer.all_special_tokens
    for text in expected:
        for token in special:
            text = text.replace(token, "")
        assert text == got.pop(0)


@pytest.mark.slow  # lm-eval's task run through the model
def test_tagged_answer_task_reads_answers_as_our_evaluation_does(tmp_path):
    """The shipped task reads each generation the three ways our evaluation does (strict, lenient, format)."""
    import lm_eval
    from lm_eval.api.model import LM

    rows = [
        {"id": "a", "prompt": "Q1", "completion": "<reasoning>r</reasoning><answer>1,200</answer><end_of_turn>", "answer": "1,200"},
        {"id": "b", "prompt": "Q2", "completion": "<reasoning>r</reasoning><answer>7</answer><end_of_turn>", "answer": "7"},
        {"id": "c", "prompt": "Q3", "completion": "<reasoning>r</reasoning><answer>5</answer><end_of_turn>", "answer": "5"},
        {"id": "d", "prompt": "Q4", "completion": "<reasoning>r</reasoning><answer>9</answer><end_of_turn>", "answer": "9"},
    ]
    answers = {  # what a model answers to each prompt: right (thousands separator dropped), wrong, unclosed (its last
        # number right), right but not the format (no reasoning; what follows </answer> is not read)
        "Q1": "<reasoning>x</reasoning><answer>1200</answer>", "Q2": "<reasoning>x</reasoning><answer>8</answer>",
        "Q3": "<reasoning>x</reasoning><answer>5", "Q4": " <answer> 9 </answer> and 12 more",
    }
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    contexts = []

    class Answers(LM):  # lm-eval's interface answering from the table above: the task is what is tested
        def generate_until(self, requests):
            contexts.extend(r.args[0] for r in requests)
            return [answers[r.args[0][-2:]] for r in requests]  # the document's prompt ends the context

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    specs, _ = harness.task_specs(["tagged_answer"], path)
    result = lm_eval.simple_evaluate(model=Answers(), tasks=specs, log_samples=False, torch_random_seed=None)
    scores = result["results"]["tagged_answer"]
    assert (scores["strict,none"], scores["lenient,none"], scores["format,none"]) == pytest.approx((0.5, 0.75, 0.5))
    assert result["versions"]["tagged_answer"] == 2.0
    # the same three readings as our own evaluation of the same texts
    ours, _ = evaluation.score("m", pd.DataFrame(rows).assign(open_ended=False),
                               [answers[r["prompt"]] for r in rows], EvaluateParams())
    assert (ours["answer_accuracy"], ours["lenient_accuracy"], ours["format_compliance"]) == pytest.approx(
        (0.5, 0.75, 0.5))

    # few-shot examples are whole tagged completions of the other rows, never the document's own
    contexts.clear()
    lm_eval.simple_evaluate(model=Answers(), tasks=specs, num_fewshot=2, log_samples=False, torch_random_seed=None)
    by_prompt = {r["prompt"]: r for r in rows}
    for context in contexts:
        own = by_prompt[context[-2:]]
        shots = [r for r in rows if r is not own and r["prompt"] + r["completion"] in context]
        assert len(shots) == 2 and own["completion"] not in context


def test_missing_task_file_is_refused_before_any_model_loads():
    with pytest.raises(HarnessError, match="no task file nowhere/task.yaml"):
        harness.check(HarnessParams(enabled=True, tasks=["nowhere/task.yaml"]))


@pytest.mark.slow
def test_evaluate_pipeline_runs_the_harness_on_base_and_tuned(project):
    """`evaluate.harness.enabled` in a project copy: lm-eval's scores beside ours in the report, the metrics
    and MLflow, with what makes them comparable, and the limit called out."""
    import lm_eval
    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(project)
    params = {
        "sft": {"max_steps": 2, "warmup_steps": 0, "checkpoint_every": 2}, "plan": {"enabled": False},
        "evaluate": {"num_prompts": 2, "max_new_tokens": 8, "batch_size": 2,
                     "harness": {"enabled": True, "limit": 2, "max_gen_toks": 8, "batch_size": 2}},
    }
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["ingest", "base_model", "format", "tokenize", "sft", "evaluate"])
    reporting = project / "data" / "08_reporting"
    metrics = json.loads((reporting / "eval_metrics.json").read_text())
    for label in ("base", "tuned"):
        scores = metrics["harness"][label]["tagged_answer"]
        assert all(0 <= scores[f"{reading},none"] <= 1 for reading in ("strict", "lenient", "format"))
    settings = metrics["harness"]["lm_eval"]
    assert settings["lm_eval_version"] == lm_eval.__version__ and settings["task_versions"] == {"tagged_answer": "2.0"}
    assert settings["limit"] == 2 and not settings["full_task"] and settings["documents"] == {"tagged_answer": 2}
    assert settings["bos"].startswith("prepended")
    report = (reporting / "eval_report.md").read_text()
    assert "## lm-evaluation-harness" in report and "limit 2 documents per task: NOT a full-task score" in report
    assert "| tagged_answer lenient,none |" in report

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id])[0]
    assert run.data.params["eval_metrics.harness.lm_eval.lm_eval_version"] == lm_eval.__version__
    assert run.data.params["eval_metrics.harness.lm_eval.limit"] == "2"
    assert "eval_metrics.harness.tuned.tagged_answer.lenient_none" in run.data.metrics
