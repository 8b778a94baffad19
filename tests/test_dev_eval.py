"""The dev split's score during training: which rows, which step is best, and how the choice is handed on."""

import copy

import pandas as pd
import pytest
from pydantic import ValidationError

from tunix_pipeline.config import GrpoParams, SftParams
from tunix_pipeline.evaluate.dev_eval import KeepStep, best_step, dev_rows
from tunix_pipeline.pipelines.export.nodes import final_checkpoint
from tunix_pipeline.stages import policy_step, selected_step, start_of
from tunix_pipeline.train.skips import passed_through


def test_dev_rows_are_the_rows_carved_from_training_sources():
    rows = pd.DataFrame({"id": list("abcd"), "split": ["test", "dev", None, "test"]})
    assert list(dev_rows(rows)["id"]) == ["b", "c"]  # no split: dev (data from before the column)
    assert list(dev_rows(rows.drop(columns="split"))["id"]) == list("abcd")


def _point(step, lenient, strict=0.0, format_=0.0):
    return {"step": step, "lenient_accuracy": lenient, "answer_accuracy": strict, "format_compliance": format_}


def test_best_step_is_the_highest_lenient_accuracy_then_strict_then_format_then_the_later():
    curve = [_point(2, 0.5), _point(4, None), _point(6, 0.75, 0.5), _point(8, 0.75, 0.25)]
    assert best_step(curve) == 6  # lenient ties: the higher strict accuracy
    assert best_step(curve[:2]) == 2 and best_step(curve[1:2]) == 4 and best_step([]) is None
    assert best_step([_point(2, 0.0, 0.0, 0.5), _point(4, 0.0, 0.0, 0.25)]) == 2  # format learnt first
    assert best_step([_point(2, 0.0), _point(4, 0.0)]) == 4  # no evidence either way: the latest, as when off


def test_keep_step_is_one_live_policy_through_copies():
    keep = KeepStep(4)
    copied = copy.deepcopy({"options": keep})["options"]  # as Tunix's RL cluster copies its training config
    keep.step = 6
    infos = [type("Info", (), {"step": s})() for s in (4, 6, 8)]
    assert copied.should_preserve(infos) == [False, True, False]


def test_the_selected_step_is_handed_on_through_the_chain():
    sft = {"checkpoint_dir": "/c/sft", "latest_step": 200, "best_step": 150, "selected_step": 150}
    assert (selected_step(sft), policy_step(sft)) == (150, 150)
    plain = {"checkpoint_dir": "/c/sft", "latest_step": 200, "best_step": None, "selected_step": 200}
    assert (selected_step(plain), policy_step(plain)) == (None, 200)  # off: the latest, as before
    assert start_of(sft) == {"start_stage": "sft", "start_checkpoint_dir": "/c/sft", "start_step": 150,
                             "start_selected": 150}
    off = passed_through(sft)  # a polish stage that is off passes SFT's choice on
    assert (off["selected_step"], off["start_step"]) == (150, 150)
    ran = {"enabled": True, "checkpoint_dir": "/c/grpo/actor", **start_of(sft), "latest_step": 20, "best_step": None,
           "selected_step": 20}
    assert final_checkpoint({"sft": sft, "grpo": ran}) == ("grpo", "/c/grpo/actor")
    # GRPO from SFT's latest step, not its selected one: stale, SFT's selected step ships
    assert final_checkpoint({"sft": sft, "grpo": {**ran, "start_step": 200}}) == ("sft", "/c/sft")


def test_dev_eval_settings():
    sft = SftParams(max_steps=10, per_device_batch_size=1, learning_rate=1e-3, checkpoint_every=5,
                    dev_eval={"every": 5})
    assert (sft.dev_eval.prompts, sft.dev_eval.max_new_tokens) == (16, 128)
    assert GrpoParams(max_steps=4).dev_eval is None
    with pytest.raises(ValidationError):
        GrpoParams(max_steps=4, dev_eval={"every": 0})
