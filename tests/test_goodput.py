"""Speed in useful tokens: each step's non-padding tokens, the rates and MFU logged from them, and the plan's useful
tokens, examples, epochs and packing warning from a tokenize report — each against a count made another way."""

import numpy as np
import pandas as pd
import pytest
import yaml

from tunix_pipeline.config import ModelParams, PlanParams, RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.planning import build_plan, markdown
from tunix_pipeline.core.progress import Progress, step_throughput
from tunix_pipeline.train.loop import BatchFeed
from tunix_pipeline.train.preference import pair_token_counts

from .conftest import ROOT

PLAN = PlanParams(**yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"])
QWEN = ModelParams(source="Qwen/Qwen2.5-0.5B", dtype="bfloat16")


def _rows(real: list[int], width: int) -> pd.DataFrame:
    """Rows of `width` slots; row i holds `real[i]` real tokens (each equal to that count), then padding."""
    segments = np.zeros((len(real), width), np.int32)
    for i, n in enumerate(real):
        segments[i, :n] = 1
    tokens = segments * np.array(real)[:, None]
    return pd.DataFrame({"id": [str(i) for i in range(len(real))], "input_tokens": list(tokens),
                         "loss_mask": list(segments), "segment_ids": list(segments), "positions": list(segments)})


# ---------------------------------------------------------------- training: per step
def test_a_step_with_known_padding_gives_exactly_that_useful_share():
    feed = BatchFeed(_rows([3] * 8, width=10), batch_size=2, seed=0)  # every row: 3 real tokens of 10
    slots, useful = feed.step_tokens(1)
    assert (slots, useful) == (20, 6)
    rates = step_throughput(2.0, slots, useful, flops_per_token=5.0, peak_flops=10.0, devices=4)
    assert rates["padding_fraction"] == pytest.approx(0.7)
    assert (rates["tokens_per_sec"], rates["useful_tokens_per_sec"]) == (10.0, 3.0)
    assert rates["mfu"] == pytest.approx(20 * 5.0 / 2.0 / 40) and rates["useful_mfu"] == pytest.approx(0.3 * rates["mfu"])
    assert "mfu" not in step_throughput(2.0, slots, useful, 5.0, None, 4)  # no peak: no MFU


def test_a_steps_useful_tokens_are_those_of_every_micro_batch_it_trained():
    real = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # one row left over each epoch: not trained
    feed = BatchFeed(_rows(real, width=12), batch_size=2, seed=3, micro_batches=2)
    for step in range(1, 7):  # two micro-batches a step, two steps an epoch, each epoch shuffled anew
        fed = [feed.batch(i)["input_tokens"] for i in ((step - 1) * 2, (step - 1) * 2 + 1)]
        counted = sum(int(b[:, 0].sum()) for b in fed)  # each row's first token is its count of real tokens
        assert feed.step_tokens(step) == (2 * 2 * 12, counted)


def test_a_preference_pair_counts_its_prompt_twice_and_both_answers():
    arrays = {"prompt_ids": np.zeros((2, 6)), "chosen_ids": np.zeros((2, 4)), "rejected_ids": np.zeros((2, 4)),
              "prompt_mask": np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]),
              "chosen_mask": np.array([[1, 1, 0, 0], [1, 1, 1, 1]]),
              "rejected_mask": np.array([[1, 0, 0, 0], [1, 1, 1, 0]])}
    slots, useful = pair_token_counts(arrays)
    assert slots == 20 and useful.tolist() == [3 + 2 + 3 + 1, 5 + 4 + 5 + 3]


def test_the_progress_line_shows_useful_tokens_beside_the_padded_rate():
    progress = Progress("sft", total=10)
    progress.first = (1, 0.0)
    line = progress.line(1, 1.0, 1.5, 1070.0, 5350.0)
    assert line == "sft: step 1/10 (10%), loss 1.5000, 1,070 useful tokens/s of 5,350 (80% padding)"
    assert progress.line(1, 1.0, None, 42.0) == "sft: step 1/10 (10%), 42 tokens/s"  # generation: no padding


# ---------------------------------------------------------------- the plan
def _report(efficiency: float, packed: float = 0.98, max_length: int = 512, examples: int = 1000) -> dict:
    """A tokenize report's training split, unpacked: one example a row at `efficiency`."""
    return {"train": {"max_length": max_length, "examples_out": examples, "rows_out": examples, "mean_length": 100.0,
                      "packed": False, "padding_efficiency": efficiency, "padding_efficiency_unpacked": efficiency,
                      "padding_efficiency_packed": packed}}


def _plan(report=None, pack=False, hardware="tpu-v5e-8", model=QWEN, max_length=512, **sft):
    sft = SftParams(**{"max_steps": 2000, "per_device_batch_size": 4, "learning_rate": 1e-3, "checkpoint_every": 500,
                       **sft})
    return build_plan(model, sft, RuntimeParams(mesh="auto"), TokenizeParams(max_length=max_length, pack=pack),
                      PLAN.model_copy(update={"hardware": hardware}), tokenize_report=report)


def test_the_plan_counts_useful_tokens_and_warns_when_padding_dominates():
    plan = _plan(_report(0.2))
    row, g = plan.selected, plan.goodput
    padded = row.global_batch * 512 / row.step_seconds  # every slot of a step's rows, over its time
    assert g["tokens_per_sec"] == pytest.approx(padded) and g["useful_tokens_per_sec"] == pytest.approx(0.2 * padded)
    assert g["useful_mfu"] == pytest.approx(0.2 * row.mfu) and g["padding_fraction"] == pytest.approx(0.8)
    assert g["examples_per_hour"] == pytest.approx(row.samples_per_hour)  # one example a row
    assert g["epochs"] == pytest.approx(2000 * 32 / 1000)
    warning = next(w for w in plan.warnings if w.startswith("padding efficiency 0.20"))
    assert "80% of each step is padding" in warning and "~4.9x more examples" in warning
    assert plan.status == "ok"  # padding costs time, not memory
    # packed, the same examples need 4.9x fewer steps of the same cost: a plan of that many steps takes as long
    fewer = _plan(_report(0.2), max_steps=round(2000 / 4.9))
    assert g["packing"]["steps"] == fewer.selected.steps
    assert g["packing"]["hours"] == pytest.approx(fewer.selected.hours) and fewer.selected.hours < row.hours
    assert warning in markdown(plan) and "**Useful work on tpu-v5e-8**" in markdown(plan)


def test_no_packing_warning_when_packing_is_on_or_padding_is_small():
    packed = _plan(_report(0.2), pack=True)
    assert not any("padding efficiency" in w for w in packed.warnings) and "packing" not in packed.goodput
    g = packed.goodput
    assert g["padding_efficiency"] == 0.98 and g["examples_per_row"] == pytest.approx(4.9)
    assert g["examples_per_hour"] == pytest.approx(4.9 * packed.selected.samples_per_hour)
    assert g["epochs"] == pytest.approx(2000 * 32 / round(1000 / 4.9))  # packed rows: 204 an epoch
    dense = _plan(_report(0.8))
    assert not any("padding efficiency" in w for w in dense.warnings) and dense.goodput["padding_efficiency"] == 0.8
    # long examples that pack badly: packing is on already, nothing to advise
    packed_badly = _plan(_report(0.2, packed=0.5), pack=True)
    assert packed_badly.goodput["padding_efficiency"] == 0.5 and "warning" not in packed_badly.goodput


def test_a_report_for_another_length_or_none_is_not_counted():
    other = _plan(_report(0.2, max_length=1024))
    assert other.goodput["padding_efficiency"] is None and "rows of 1024 tokens" in other.goodput["padding_note"]
    assert other.goodput["examples_per_hour"] == pytest.approx(other.selected.samples_per_hour)  # unpacked
    none = _plan(None, pack=True)
    assert none.goodput["useful_tokens_per_sec"] is None and none.goodput["examples_per_hour"] is None
    assert "padding not counted: no tokenize report" in markdown(none)


def test_the_seeds_session_estimate_is_set_beside_this_plans_figure():
    # tpu_full's job on the Kaggle v5e-8 with GSM8K's tokenize report (padding efficiency 0.197)
    plan = _plan(_report(0.197, packed=0.985, max_length=1024, examples=7473), hardware="kaggle-tpu-v5e-8",
                 model=ModelParams(source="google/gemma-2b", dtype="bfloat16"), max_length=1024, max_steps=3000,
                 checkpoint_every=1000, remat="decoder", loss_chunk_size=256)
    row, quote = plan.selected, plan.goodput["session_quote"]
    assert f"-> {row.steps_per_session * row.global_batch:,} examples in a 9 h session" in quote
    assert quote.endswith("seed 000 estimated ~100K samples in a 9 h session") and quote in markdown(plan)
    assert "~5.0x more examples" in plan.goodput["warning"]
