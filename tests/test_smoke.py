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
    assert sft["latest_step"] == 200 and sft["mesh"] == {"fsdp": 4, "tp": 2}
    assert (project / "data" / "06_models" / "sft_checkpoints" / "200").is_dir()
    metrics = json.loads((reporting / "eval_metrics.json").read_text())
    assert metrics["tuned"]["eval_loss"] < 0.6 * metrics["base"]["eval_loss"]
    assert metrics["tuned"]["format_compliance"] > metrics["base"]["format_compliance"]
    samples = [json.loads(line) for line in (project / "data" / "07_model_output" / "eval_samples.jsonl").open()]
    assert {s["model"] for s in samples} == {"base", "tuned"} and all(isinstance(s["reference"], str) for s in samples)
    assert "| eval_loss |" in (reporting / "eval_report.md").read_text()

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.data.tags["kedro.pipelines"] == "smoke"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in sorted(losses, key=lambda m: m.step)] == list(range(1, 201))
    for name in ("train/learning_rate", "train/grad_norm", "train/tokens_per_sec"):
        assert client.get_metric_history(run.info.run_id, name), name
    assert run.data.metrics["eval_metrics.tuned.eval_loss"] == pytest.approx(metrics["tuned"]["eval_loss"])
    assert run.data.params["sft.max_steps"] == "200"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"eval_samples.jsonl", "eval_metrics.json", "data_quality_report.json", "tokenize_report.json"} <= artifacts

    # Rerunning `sft` with a longer budget resumes from the latest checkpoint.
    with KedroSession.create(project_path=project, runtime_params={"sft": {"max_steps": 210}}) as session:
        session.run(pipeline_names=["sft"])
    resumed = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert (resumed["resumed_from_step"], resumed["latest_step"], resumed["steps_this_run"]) == (200, 210, 10)
    assert len(resumed["loss_history"]) == 210

    exported = json.loads((project / "data" / "06_models" / "exported_model.json").read_text())
    model, tokenizer = load_pretrained(exported["path"])
    assert exported["checkpoint_step"] == 200 and tokenizer is not None

    # LoRA through the same stages: only adapters are trained and checkpointed, then merged on export.
    lora_run = {
        "model": {"lora": {"rank": 4, "alpha": 8.0}},
        "sft": {"max_steps": 20, "checkpoint_every": 10, "checkpoint_dir": "data/06_models/lora_checkpoints"},
        "export": {"output_dir": "data/06_models/lora_export"},
    }
    with KedroSession.create(project_path=project, runtime_params=lora_run) as session:
        session.run(pipeline_names=["sft", "evaluate", "export"])
    sft = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert sft["lora"] and sft["trainable_params"] < sft["total_params"] / 4
    assert json.loads((reporting / "eval_metrics.json").read_text())["tuned"]["checkpoint_step"] == 20
    assert (project / "data" / "06_models" / "lora_export" / "model.safetensors").is_file()
