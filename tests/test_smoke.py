"""The whole smoke DAG through a KedroSession, then a resumed SFT run."""

import json

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tunix_pipeline.models import load_pretrained

pytestmark = pytest.mark.slow


def test_smoke_pipeline_end_to_end_then_resume(project):
    bootstrap_project(project)
    with KedroSession.create(project_path=project) as session:
        session.run(pipeline_names=["smoke"])

    reporting = project / "data" / "08_reporting"
    smoke = json.loads((reporting / "smoke_report.json").read_text())
    assert smoke["passed"] and smoke["loss_ratio"] <= 0.6
    sft = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert sft["latest_step"] == 200 and sft["mesh"] == {"data": 1, "fsdp": 4, "tp": 2}
    assert (project / "data" / "06_models" / "sft_checkpoints" / "200").is_dir()
    metrics = json.loads((reporting / "eval_metrics.json").read_text())
    assert metrics["tuned"]["eval_loss"] < 0.6 * metrics["base"]["eval_loss"]
    assert metrics["tuned"]["format_compliance"] > metrics["base"]["format_compliance"]
    samples = [json.loads(line) for line in (project / "data" / "07_model_output" / "eval_samples.jsonl").open()]
    assert {s["model"] for s in samples} == {"base", "tuned"} and all(isinstance(s["reference"], str) for s in samples)
    assert "| eval_loss |" in (reporting / "eval_report.md").read_text()
    assert (reporting / "loss_curve.png").stat().st_size > 0 and (reporting / "grpo_curves.png").stat().st_size > 0

    # DPO on pairs from the SFT model's own samples: they separate on held-out prompts' pairs
    pairs = json.loads((reporting / "preference_pairs.json").read_text())
    assert pairs["pairs"] == "from_rewards" and pairs["train"]["pairs"] >= 32 and pairs["eval"]["pairs"] >= 10
    preference = json.loads((project / "data" / "06_models" / "preference_result.json").read_text())
    assert preference["enabled"] and preference["start_step"] == 200 and preference["latest_step"] == 30
    assert preference["reference_model"] and (project / "data" / "06_models" / "preference_checkpoints" / "30").is_dir()
    assert preference["heldout_pair_accuracy_before"] == 0.5  # the policy is its reference: every pair a tie
    # ~24 held-out pairs drawn by the sampler: 30 DPO steps order more than half of them, where the untrained
    # policy ties every one (0.5); the pairs differ with the sampler's random stream and the SFT model's float
    # rounding (13 of 21 after the loss's output layer went chunked, 16 of 24 before)
    assert preference["heldout_pair_accuracy"] >= 0.6
    after_pref = json.loads((reporting / "preference_eval_metrics.json").read_text())
    assert after_pref["sft"]["eval_loss"] == pytest.approx(metrics["tuned"]["eval_loss"])
    assert after_pref["preference"]["checkpoint_step"] == 30 and smoke["checks"]["preference_model_evaluated"]

    # GRPO from the DPO policy, then the evaluation after it
    grpo = json.loads((project / "data" / "06_models" / "grpo_result.json").read_text())
    assert grpo["enabled"] and grpo["start_step"] == 30 and grpo["latest_step"] == 4 and grpo["reference_model"]
    assert grpo["start_checkpoint_dir"] == preference["checkpoint_dir"] and grpo["start_stage"] == "preference"
    assert (project / "data" / "06_models" / "grpo_checkpoints" / "actor" / "4").is_dir()
    assert [h["step"] for h in grpo["history"]] == [1, 2, 3, 4]
    assert all(h["reward"] is not None and h["kl"] is not None for h in grpo["history"])
    assert smoke["checks"]["grpo_model_evaluated"] and smoke["checks"]["last_trained_policy_exported"]
    after = json.loads((reporting / "grpo_eval_metrics.json").read_text())
    assert set(after) == {"preference", "grpo"} and after["grpo"]["checkpoint_step"] == 4
    # the same DPO checkpoint, rows and compiled evaluation: equal (approx only for the trip through JSON)
    assert after["preference"]["eval_loss"] == pytest.approx(after_pref["preference"]["eval_loss"])
    grpo_report = (reporting / "grpo_eval_report.md").read_text()
    assert "| metric | preference | grpo | grpo − preference |" in grpo_report
    assert "GRPO's mean reward " in grpo_report and " over 4 steps: slope " in grpo_report  # the trend, either way
    grpo_samples = [json.loads(line) for line in (project / "data" / "07_model_output" / "grpo_eval_samples.jsonl").open()]
    assert {s["model"] for s in grpo_samples} == {"preference", "grpo"}

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.data.tags["kedro.pipelines"] == "smoke"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in sorted(losses, key=lambda m: m.step)] == list(range(1, 201))
    for name in ("train/learning_rate", "train/grad_norm", "train/tokens_per_sec", "train/useful_tokens_per_sec",
                 "train/padding_fraction"):
        assert client.get_metric_history(run.info.run_id, name), name
    # the sft preflight read the tokenize report the run had just written: its plan counts those rows' padding
    tokenized = json.loads((project / "data" / "08_reporting" / "tokenize_report.json").read_text())["train"]
    sft_plan = json.loads((project / "data" / "08_reporting" / "sft_plan.json").read_text())
    assert sft_plan["goodput"]["padding_efficiency"] == tokenized["padding_efficiency_unpacked"]  # base: no packing
    assert run.data.metrics["eval_metrics.tuned.eval_loss"] == pytest.approx(metrics["tuned"]["eval_loss"])
    assert run.data.params["sft.max_steps"] == "200"
    # the preference stage under its own prefix: SFT's train/loss above is untouched
    for name in ("preference/train/loss", "preference/train/rewards/margin", "preference/train/rewards/accuracy"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, name)) == list(range(1, 31)), name
    held_out = client.get_metric_history(run.info.run_id, "preference/eval/pair_accuracy")
    assert sorted((m.step, m.value) for m in held_out)[0] == (0, 0.5)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"eval_samples.jsonl", "eval_metrics.json", "data_quality_report.json", "tokenize_report.json"} <= artifacts
    assert {"eval_report.md", "loss_curve.png", "grpo_curves.png", "grpo_result.json", "grpo_eval_report.md",
            "grpo_eval_samples.jsonl", "grpo_eval_metrics.json", "preference_result.json", "preference_curves.png",
            "preference_eval_report.md", "preference_pairs_report.json"} <= artifacts
    # GRPO per step, each metric once per step (a closed SFT trainer must not log it a second time)
    for name in ("reward/train/total/mean", "reward/train/total/std", "reward/train/answer/mean",
                 "reward/train/format_exact/std", "completions/train/mean_length"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, name)) == [0, 1, 2, 3], name
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "actor/train/kl")) == [1, 2, 3, 4]
    assert run.data.metrics["grpo_eval_metrics.grpo.eval_loss"] == pytest.approx(after["grpo"]["eval_loss"])

    # Rerunning `sft` with a longer budget resumes from the latest checkpoint.
    with KedroSession.create(project_path=project, runtime_params={"sft": {"max_steps": 210}}) as session:
        session.run(pipeline_names=["sft"])
    resumed = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert (resumed["resumed_from_step"], resumed["latest_step"], resumed["steps_this_run"]) == (200, 210, 10)
    assert len(resumed["history"]) == 210

    exported = json.loads((project / "data" / "06_models" / "exported_model.json").read_text())
    model, tokenizer = load_pretrained(exported["path"])
    assert (exported["stage"], exported["checkpoint_step"]) == ("grpo", 4) and tokenizer is not None

    # LoRA through the same stages: only adapters are trained and checkpointed (by SFT, then GRPO), then merged.
    lora_run = {
        "model": {"lora": {"rank": 4, "alpha": 8.0}},
        "sft": {"max_steps": 20, "checkpoint_every": 10, "checkpoint_dir": "data/06_models/lora_checkpoints"},
        "grpo": {"max_steps": 1, "beta": 0.0, "loss_variant": "dr-grpo", "checkpoint_dir": "data/06_models/lora_grpo"},
        "preference": {"enabled": False},  # LoRA preference training: tests/test_preference.py
        "export": {"output_dir": "data/06_models/lora_export"},
    }
    with KedroSession.create(project_path=project, runtime_params=lora_run) as session:
        session.run(pipeline_names=["sft", "evaluate", "grpo", "export"])
    sft = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert sft["lora"] and sft["trainable_params"] < sft["total_params"] / 4
    assert json.loads((reporting / "eval_metrics.json").read_text())["tuned"]["checkpoint_step"] == 20
    grpo = json.loads((project / "data" / "06_models" / "grpo_result.json").read_text())
    assert grpo["lora"] and grpo["start_step"] == 20 and grpo["latest_step"] == 1 and not grpo["reference_model"]
    exported = json.loads((project / "data" / "06_models" / "exported_model.json").read_text())
    assert (exported["stage"], exported["checkpoint_step"], exported["merged_lora"]) == ("grpo", 1, True)
    assert (project / "data" / "06_models" / "lora_export" / "model.safetensors").is_file()

    # GRPO switched off: the SFT checkpoint passes through and export ships it
    with KedroSession.create(project_path=project, runtime_params={**lora_run, "grpo": {"enabled": False}}) as session:
        session.run(pipeline_names=["grpo", "export"])
    assert json.loads((project / "data" / "06_models" / "grpo_result.json").read_text())["enabled"] is False
    assert "GRPO is off" in (reporting / "grpo_eval_report.md").read_text()
    exported = json.loads((project / "data" / "06_models" / "exported_model.json").read_text())
    assert (exported["stage"], exported["checkpoint_step"]) == ("sft", 20)
