"""Scoring in the plan: the evaluation's and SFT's dev evaluation's generation against a hand computation, and the
sft preflight stopping a run whose scoring cannot fit before SFT starts."""

import pandas as pd
import pytest

from tunix_pipeline.config import (
    DevEvalParams,
    EvaluateParams,
    PlanParams,
    RuntimeParams,
    SftParams,
    TokenizeParams,
)
from tunix_pipeline.planning import DoesNotFit, build_plan, markdown
from tunix_pipeline.planning.memory import GIB
from tunix_pipeline.planning.scoring import add_scoring, refusal

from .test_planning_grpo import BASE, GEMMA_2B, PLAN, SFT


def _plan():
    return build_plan(GEMMA_2B, SFT, RuntimeParams(), TokenizeParams(max_length=512), PLAN)


def test_scoring_holds_the_weights_and_the_samplers_cache_logits_and_prefill():
    plan = _plan()
    m = plan.selected.memory
    dev = DevEvalParams(every=10, batch_size=64, max_new_tokens=256)
    add_scoring(plan, EvaluateParams(batch_size=64, max_new_tokens=256), 512, dev, 512)
    # 64 rows over the 8 chips of a v5e-8, each a bf16 cache of 512 + 2 x 256 positions in 18 layers (keys and values,
    # one head of 256), a step's float32 logits over 256,000 words and the prefill's float32 hidden states (2,048)
    rows = 8
    generation = 18 * 2 * rows * 1024 * 256 * 2 + rows * (256_000 + 512 * 2048) * 4
    scoring = plan.summary()["scoring"]
    assert scoring["evaluation"] == {"gib": round((m.params - m.grads + generation) / GIB, 3), "rows": 64,
                                     "cache_positions": 1024, "fits": True, "process_peak_gib": None}
    # the dev evaluation runs between SFT's steps, beside the trainer's weights and optimizer state
    assert (scoring["dev evaluation"]["gib"] - scoring["evaluation"]["gib"]) * GIB == pytest.approx(
        m.grads + m.optimizer, abs=2e-3 * GIB)
    assert plan.status != "over" and "| evaluation | 64 x 1,024 |" in markdown(plan)
    # nothing to score, or no SFT steps this session: no phase
    assert add_scoring(_plan(), EvaluateParams(), None, None, None).scoring == {}


def test_a_scoring_that_cannot_fit_is_over_and_says_what_to_lower():
    plan = add_scoring(_plan(), EvaluateParams(batch_size=8 * 512, max_new_tokens=512), 2048, None, None)
    assert plan.status == "over" and not plan.scoring["evaluation"]["fits"]
    assert refusal(plan).startswith("the evaluation needs ")
    assert "a KV cache of 4096 rows x 3072 positions" in refusal(plan)
    assert refusal(plan).endswith("lower evaluate.batch_size or evaluate.max_new_tokens, or set "
                                  "evaluate.max_prompt_length; stopped before SFT, nothing trained")
    dev = add_scoring(_plan(), EvaluateParams(), 512, DevEvalParams(every=5, batch_size=8 * 512), 2048)
    assert dev.scoring["evaluation"]["fits"] and "lower sft.dev_eval.batch_size" in refusal(dev)


def test_the_sft_preflight_sizes_scoring_from_the_prompts_it_will_score(tiny_model_dir, tokenizer):
    from tunix_pipeline.generate.generation import next_power_of_two, prompt_lengths
    from tunix_pipeline.pipelines.sft.nodes import check_sft_fits

    prompts = [f"<bos><start_of_turn>user\nAda has {i} apples.<end_of_turn>\n<start_of_turn>model\n" for i in range(12)]
    eval_formatted = pd.DataFrame({"prompt": prompts, "answer": [str(i) for i in range(12)],
                                   "split": ["dev"] * 4 + ["test"] * 8})
    shots = eval_formatted[eval_formatted["split"] == "test"].assign(prompt=lambda d: "Q: 1 + 1? A: 2. " * 40 + d["prompt"])
    sft = SftParams(max_steps=10, per_device_batch_size=1, learning_rate=1e-4, checkpoint_every=5,
                    dev_eval={"every": 5, "prompts": 4, "max_new_tokens": 16, "batch_size": 8})
    rows = pd.DataFrame({"input_tokens": [[1] * 128] * 8})
    host = {"kind": "cpu", "devices": 8, "memory_gib": 4.0, "peak_tflops": 0.02}
    plan = PlanParams(**{**BASE, "hardware": "host", "profiles": {**BASE["profiles"], "host": host},
                         "xla_check": {"enabled": False}})

    def preflight(**evaluate):
        return check_sft_fits({"path": str(tiny_model_dir)}, rows, None, GEMMA_2B.model_copy(
            update={"source": str(tiny_model_dir), "dtype": "float32"}), sft, RuntimeParams(),
            TokenizeParams(max_length=128), plan, eval_formatted=eval_formatted, eval_few_shot=shots,
            evaluate=EvaluateParams(**{"max_new_tokens": 32, **evaluate}))

    scoring = preflight()[1]["scoring"]
    zero_shot = next_power_of_two(max(prompt_lengths(tokenizer, prompts[4:])))
    assert scoring["evaluation"]["cache_positions"] == zero_shot + 64  # the test rows, zero-shot
    assert scoring["dev evaluation"]["cache_positions"] == next_power_of_two(
        max(prompt_lengths(tokenizer, prompts[:4]))) + 32
    few_shot = next_power_of_two(max(prompt_lengths(tokenizer, shots["prompt"].tolist())))
    assert few_shot > zero_shot  # the k-shot prompts size the cache where they are scored
    assert preflight(few_shot=3)[1]["scoring"]["evaluation"]["cache_positions"] == few_shot + 64
    with pytest.raises(DoesNotFit, match=r"^the evaluation needs .* per device on host .*: lower evaluate.batch_size"):
        preflight(batch_size=8 * 200_000)


def test_the_evaluation_computes_in_the_models_dtype_the_dev_evaluation_in_sfts():
    """bf16 compute over float32 weights (`sft.compute_dtype`): the dev evaluation samples from the training model (a
    bf16 cache), the evaluation from the model loaded in float32 (a float32 cache, no bf16 copy of the weights)."""
    sft = SFT.model_copy(update={"compute_dtype": "bfloat16"})
    plan = build_plan(GEMMA_2B.model_copy(update={"dtype": "float32"}), sft, RuntimeParams(),
                      TokenizeParams(max_length=512), PLAN)
    add_scoring(plan, EvaluateParams(batch_size=64, max_new_tokens=256), 512,
                DevEvalParams(every=10, batch_size=64, max_new_tokens=256), 512)
    m, cache = plan.selected.memory, 18 * 2 * 8 * 1024 * 256  # 8 rows a chip, 1,024 positions
    rest = 8 * (256_000 + 512 * 2048) * 4
    weights = m.params - m.grads - plan.job.arch.params / 8 * 2  # less the weights' bf16 copy (sharded over 8)
    assert plan.scoring["evaluation"]["gib"] == pytest.approx((weights + cache * 4 + rest) / GIB, abs=2e-3)
    assert plan.scoring["dev evaluation"]["gib"] == pytest.approx((m.params + m.optimizer + cache * 2 + rest) / GIB,
                                                                  abs=2e-3)
