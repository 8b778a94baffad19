"""Training across sessions: the plan, the ledger, continuing from a parent checkpoint, lineage in MLflow."""

import json
import logging

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from omegaconf import OmegaConf

from tunix_pipeline.run.sessions import Ledger, SessionPlanDone, apply_current_session

from .test_training import formatted  # noqa: F401  (the fixture)

PLAN = {
    "weekly_hours": 20,
    "plan": [
        {"name": "first", "hours": 9},
        {"name": "second", "hours": 8, "params": {"sft": {"learning_rate": 1.0e-5}}},
    ],
}


def _params(root, **sessions):
    return {
        "runtime": {"output_root": str(root)},
        "model": {"source": "google/gemma-2b"},
        "sft": {"checkpoint_dir": f"{root}/06_models/sft_checkpoints", "learning_rate": 2.0e-5, "max_steps": 10},
        "grpo": {"checkpoint_dir": f"{root}/06_models/grpo_checkpoints"},
        "sessions": {**PLAN, **sessions},
    }


def test_the_ledger_picks_the_next_session_and_its_parent(tmp_path):
    root = tmp_path / "out"
    first = apply_current_session(_params(root))
    assert first["sessions"]["current"]["name"] == "first" and first["sft"]["init_from"] is None
    assert first["sft"]["checkpoint_dir"].endswith("sft_checkpoints/first")
    assert first["sft"]["time_budget_hours"] == 9 and first["sft"]["learning_rate"] == 2.0e-5

    Ledger(root).record_finished(0, "first", {"run_id": "r1", "checkpoint_dir": first["sft"]["checkpoint_dir"], "step": 10})
    second = apply_current_session(_params(root), runtime_params={"sft": {"max_steps": 3}})
    assert second["sessions"]["current"]["name"] == "second"
    assert second["sessions"]["current"]["parent"]["run_id"] == "r1"
    assert second["sft"]["init_from"] == first["sft"]["checkpoint_dir"]
    assert second["sft"]["learning_rate"] == 1.0e-5  # the session's own parameters
    assert second["sft"]["max_steps"] == 3  # --params still win
    assert second["model"]["source"] == "google/gemma-2b"  # a hub model stays a hub id
    # paths under the root are stored relative to it, so the folder can be attached elsewhere
    assert json.loads((root / "sessions.json").read_text())["finished"]["first"]["checkpoint_dir"] == (
        "06_models/sft_checkpoints/first"
    )

    # a fresh machine: nothing in its own output root, the last session's output attached read-only
    fresh = apply_current_session(_params(tmp_path / "new", previous_root=str(root)))
    assert fresh["sessions"]["current"]["name"] == "second"
    assert fresh["sft"]["init_from"] == str(root.resolve() / "06_models/sft_checkpoints/first")
    assert fresh["sft"]["checkpoint_dir"] == f"{tmp_path / 'new'}/06_models/sft_checkpoints/second"

    Ledger.load(root).record_finished(1, "second", {"run_id": "r2", "checkpoint_dir": "x", "step": 3})
    assert apply_current_session(_params(root))["sessions"]["current"]["plan_done"] is True


def test_no_plan_leaves_parameters_alone(tmp_path):
    params = _params(tmp_path, plan=[])
    assert apply_current_session(params) is params


def test_weekly_hours_count_the_last_seven_days(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.record_run("first", started=1_000_000.0, seconds=9 * 3600, run_id="a", outcome="finished")
    ledger.record_run("second", started=1_000_000.0 + 8 * 24 * 3600, seconds=3600, run_id="b", outcome="stopped")
    assert ledger.hours_this_week(now=1_000_000.0 + 8 * 24 * 3600 + 60) == pytest.approx(1.0)
    assert ledger.hours_this_week(now=1_000_000.0 + 3600) == pytest.approx(10.0)


STAGES = ["ingest", "base_model", "format", "tokenize", "sft"]


class _Messages(logging.Handler):
    """What the hooks log, whatever Kedro's logging configuration does with it."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


@pytest.mark.slow
def test_sessions_continue_on_new_data_with_lineage(project):
    """Session 1 trains on GSM8K-style rows; session 2 starts from its checkpoint on the Alpaca-style rows;
    session 3 polishes session 2's model with GRPO only."""
    env = project / "conf" / "two_sessions"
    env.mkdir()
    raw = "data/01_raw"
    smoke = yaml.safe_load((project / "conf" / "gpu_smoke" / "parameters.yml").read_text())  # the tiny model's sizes
    (env / "parameters.yml").write_text(yaml.safe_dump(OmegaConf.to_container(OmegaConf.merge(smoke, {
        "sft": {"max_steps": 40, "checkpoint_every": 20},
        "plan": {"xla_check": {"enabled": False}},
        "preference": {"enabled": False},  # SFT -> GRPO here; the preference stage's sessions: test_recipes.py
        "sessions": {
            "weekly_hours": 20,
            "plan": [
                {"name": "gsm", "hours": 6,
                 "params": {"ingest": {"sources": [{"name": "gsm", "path": f"{raw}/arith_gsm8k.jsonl", "format": "gsm8k"}]}}},
                {"name": "alpaca", "hours": 6,
                 "params": {"ingest": {"sources": [{"name": "alpaca", "path": f"{raw}/arith_alpaca.csv", "format": "alpaca"}]},
                            "sft": {"max_steps": 10, "learning_rate": 0.001, "warmup_steps": 2}}},
                # no SFT, one GRPO step on session 2's model
                {"name": "polish", "hours": 6, "params": {"sft": {"max_steps": 0}, "grpo": {"max_steps": 1}}},
            ],
        },
    }))))
    bootstrap_project(project)  # 6 h a session: a session's budget runs from the process's start (this pytest's)
    models = project / "data" / "06_models"
    # what an earlier run in this process (a notebook kernel, this test session) left in the hooks must not leak in
    from tunix_pipeline.run.hooks import SessionHooks
    from tunix_pipeline.settings import HOOKS

    next(h for h in HOOKS if isinstance(h, SessionHooks))._results = {"grpo_result": {"enabled": True, "checkpoint_dir": "/elsewhere/actor", "latest_step": 4}}

    def run(stages=STAGES):
        with KedroSession.create(project_path=project, env="two_sessions") as session:
            session.run(pipeline_names=stages)
        return json.loads((models / "sft_result.json").read_text())

    first = run()
    assert (first["latest_step"], first["steps_this_run"]) == (40, 40)
    assert first["checkpoint_dir"] == str((models / "sft_checkpoints" / "gsm").resolve())
    messages = _Messages()
    logging.getLogger("tunix_pipeline.run.hooks").addHandler(messages)
    try:
        second = run()
    finally:
        logging.getLogger("tunix_pipeline.run.hooks").removeHandler(messages)
    brief = next(m for m in messages.seen if m.startswith("session 2 of 3"))
    assert "continues from session 'gsm' (step 40" in brief and "10 SFT steps" in brief and "of 20 h" in brief
    assert any(m.startswith("session 'alpaca' expects about") and "within its 6 h" in m for m in messages.seen)

    # a new run on the parent's weights: step 0, a fresh schedule, the new data, its own checkpoints
    assert (second["resumed_from_step"], second["latest_step"], second["steps_this_run"]) == (0, 10, 10)
    assert second["checkpoint_dir"] == str((models / "sft_checkpoints" / "alpaca").resolve())
    assert second["parent_checkpoint"] == first["checkpoint_dir"] and second["parent_step"] == 40
    assert second["base_model"] == first["base_model"]  # the built tiny model is carried, tokenizer and all
    sources = set(pd.read_json(project / "data" / "02_intermediate" / "train_records.jsonl", lines=True)["source"])
    assert sources == {"alpaca"}
    # it starts where session 1 ended, far below an untrained model's loss
    assert second["first_loss"] < 0.5 * first["first_loss"]

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time ASC"])
    parent, child = runs[0], runs[1]
    assert child.data.tags["lineage.parent_run_id"] == parent.info.run_id == second["parent_run_id"]
    assert child.data.tags["lineage.parent_checkpoint"] == first["checkpoint_dir"]
    assert child.data.tags["lineage.parent_step"] == "40"
    assert (child.data.tags["session.name"], child.data.tags["session.parent"]) == ("alpaca", "gsm")

    # session 3: GRPO only, on session 2's checkpoint, which passes through SFT untouched
    third = run(STAGES + ["grpo"])
    assert (third["steps_this_run"], third["checkpoint_dir"], third["latest_step"]) == (0, second["checkpoint_dir"], 10)
    grpo = json.loads((models / "grpo_result.json").read_text())
    assert (grpo["start_checkpoint_dir"], grpo["start_step"], grpo["latest_step"]) == (second["checkpoint_dir"], 10, 1)
    assert grpo["checkpoint_dir"].endswith("grpo_checkpoints/polish/actor")

    ledger = json.loads((project / "data" / "sessions.json").read_text())
    assert [r["outcome"] for r in ledger["runs"]] == ["finished"] * 3
    assert set(ledger["finished"]) == {"gsm", "alpaca", "polish"}
    assert ledger["finished"]["polish"]["grpo_checkpoint_dir"] == "06_models/grpo_checkpoints/polish/actor"

    with pytest.raises(SessionPlanDone, match="every session of sessions.plan is finished"):
        run()


@pytest.mark.slow
def test_a_lora_run_starts_from_another_runs_adapters(tmp_path, tiny_model_dir, tokenizer, formatted):  # noqa: F811
    """`sft.init_from` with LoRA: the parent's trained adapters, the same frozen base; a full model refuses them."""
    from flax import nnx

    from tunix_pipeline.config import ModelParams, SftParams, TokenizeParams
    from tunix_pipeline.data.tokenization import tokenize_split
    from tunix_pipeline.models import load_run_model
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train.checkpoints import start_from
    from tunix_pipeline.train.sft import train

    from .test_training import MESH

    rows = tokenize_split(formatted, tokenizer, TokenizeParams(max_length=48))[0]
    mesh = make_mesh(MESH)
    lora = ModelParams(source=str(tiny_model_dir), lora={"rank": 4, "alpha": 8.0})
    sft = SftParams(max_steps=3, per_device_batch_size=1, learning_rate=1e-2, warmup_steps=1,
                    checkpoint_every=3, checkpoint_dir=str(tmp_path / "parent"))
    parent, _ = load_run_model(tiny_model_dir, lora, mesh)
    train(parent, rows, rows.iloc[:0], sft, mesh)

    def flat(model, kind):
        return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, kind))}

    child, _ = load_run_model(tiny_model_dir, lora, mesh)
    untrained = flat(child, nnx.LoRAParam)
    lineage = start_from(child, tmp_path / "parent", tmp_path / "child")
    assert lineage["parent_step"] == 3 and lineage["parent_checkpoint"] == str((tmp_path / "parent").resolve())
    trained, loaded = flat(parent, nnx.LoRAParam), flat(child, nnx.LoRAParam)
    assert any(not np.array_equal(untrained[k], trained[k]) for k in trained)
    assert all(np.array_equal(loaded[k], trained[k]) for k in trained)

    full, _ = load_run_model(tiny_model_dir, ModelParams(source=str(tiny_model_dir)), mesh)
    with pytest.raises(ValueError, match="must have the same model.source and model.lora"):
        start_from(full, tmp_path / "parent", tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="sft.init_from: no checkpoint in"):
        start_from(full, tmp_path / "nowhere", tmp_path / "full")
