"""The Kedro project as users run it: configuration, CLI, MLflow, kedro-viz."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tunix_pipeline.readers import DataError

KEDRO = str(Path(sys.executable).parent / "kedro")


def _session(path, env=None, **runtime_params):
    bootstrap_project(path)
    return KedroSession.create(project_path=path, env=env, runtime_params=runtime_params or None)


def _runs(path):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{path / 'data' / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(experiments, order_by=["start_time DESC"])


@pytest.mark.parametrize("env", [None, "gpu_smoke", "tpu_full"])
def test_every_environment_validates(project, env):
    with _session(project, env) as session:
        params = session.load_context().params
    assert params["sft"].checkpoint_every > 0 and params["tokenize"].max_length > 8
    if env == "tpu_full":
        assert params["model"].source == "google/gemma-2b" and params["model"].dtype == "bfloat16"
        assert params["tokenize"].max_length == 1024 and params["sft"].per_device_batch_size == 4
        assert (params["sft"].checkpoint_every, params["sft"].keep_checkpoints) == (40, 3)
        assert params["sft"].optimizer == "adamw" and params["sft"].warmup_steps > 0
        assert params["runtime"].mesh == "auto"
        # only what differs is in the environment: base keys survive the merge
        assert params["sft"].keep_checkpoints == 3 and params["evaluate"].temperature == 0
        # seed 000's week as a session plan: the first session, its own checkpoints and 9 h budget
        assert params["sessions"]["current"]["name"] == "sft_gsm8k" and params["sft"].time_budget_hours == 9
        assert params["sft"].checkpoint_dir == "data/06_models/sft_checkpoints/sft_gsm8k"


def test_a_wrong_key_fails_before_any_node_runs(project):
    (project / "conf" / "local" / "parameters.yml").write_text("sft:\n  max_step: 5\n")
    with _session(project) as session, pytest.raises(Exception, match=r"(?s)'sft'.*max_step.*Extra inputs"):
        session.run(pipeline_names=["smoke"])
    assert not list((project / "data").glob("0[2-8]_*/*")), "a node ran before validation"


def test_a_failing_node_marks_the_mlflow_run_failed(project):
    (project / "conf" / "local" / "parameters.yml").write_text(
        "ingest:\n  sources:\n    - {name: missing, path: data/01_raw/nope.jsonl, format: gsm8k}\n"
    )
    with _session(project) as session, pytest.raises(DataError, match="file not found"):
        session.run(pipeline_names=["ingest"])
    _, runs = _runs(project)
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.tags["kedro.pipelines"] == "ingest"


@pytest.mark.parametrize("flag", [["--pipeline", "ingest"], ["--pipelines=ingest"]])
def test_cli_runs_a_pipeline_with_either_flag(project, flag):
    result = subprocess.run([KEDRO, "run", *flag], cwd=project, capture_output=True, text=True, env=os.environ)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((project / "data" / "08_reporting" / "data_quality.json").read_text())
    assert report["totals"]["kept"] == 400
    _, runs = _runs(project)
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["data_quality_report.totals.rows_read"] == 400


def test_kedro_viz_build_shows_every_pipeline_with_layers(project):
    result = subprocess.run([KEDRO, "viz", "build"], cwd=project, capture_output=True, text=True, env=os.environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (project / "build" / "index.html").is_file()
    main = json.loads((project / "build" / "api" / "main").read_text())
    assert {p["id"] for p in main["pipelines"]} >= {
        "__default__", "smoke", "ingest", "format", "tokenize", "sft", "evaluate"
    }
    tasks = {n["name"] for n in main["nodes"] if n["type"] == "task"}
    assert {"ingest_sources", "prepare_base_model", "tokenize", "train_sft", "evaluate_models"} <= tasks
    default = json.loads((project / "build" / "api" / "pipelines" / "__default__").read_text())
    layers = default["layers"]  # kedro-viz orders them by the data flow
    assert set(layers) == {"intermediate", "primary", "model_input", "models", "model_output", "reporting"}
    assert layers[:4] == ["intermediate", "primary", "model_input", "models"]


def test_a_mesh_that_does_not_fit_fails_before_any_node_runs(project):
    (project / "conf" / "local" / "parameters.yml").write_text("runtime:\n  mesh: {fsdp: 16, tp: 2}\n")
    with _session(project) as session, pytest.raises(ValueError, match=r"needs 32 devices but JAX sees 8"):
        session.run(pipeline_names=["smoke"])
    assert not list((project / "data").glob("0[2-8]_*/*"))


@pytest.mark.slow
def test_kill_9_during_sft_then_rerun_continues_one_mlflow_run(project):
    import signal
    import time

    run = [KEDRO, "run", "--pipelines=sft", "--params", "sft.checkpoint_every=20,sft.max_steps=80"]
    prepare = subprocess.run([KEDRO, "run", "--pipelines=ingest,base_model,format,tokenize"], cwd=project,
                             capture_output=True, text=True, env=os.environ)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    victim = subprocess.Popen(run, cwd=project, env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = project / "data" / "06_models" / "sft_checkpoints" / "40"
    deadline = time.time() + 300
    while not checkpoint.exists():
        assert victim.poll() is None and time.time() < deadline, "sft ended before it could be killed"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    client, runs = _runs(project)
    sft_runs = [r for r in runs if r.data.tags.get("kedro.pipelines") == "sft"]
    assert len(sft_runs) == 1 and sft_runs[0].info.status == "RUNNING"  # killed: never closed

    rerun = subprocess.run(run, cwd=project, capture_output=True, text=True, env=os.environ)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    client, runs = _runs(project)
    sft_runs = [r for r in runs if r.data.tags.get("kedro.pipelines") == "sft"]
    assert len(sft_runs) == 1, "the rerun should continue the killed run"
    assert sft_runs[0].info.status == "FINISHED" and sft_runs[0].data.tags["resumed"] == "true"
    steps = [m.step for m in client.get_metric_history(sft_runs[0].info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 81)), "one loss value per step, none missing, none twice"
    result = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert result["resumed_from_step"] >= 40 and result["latest_step"] == 80


@pytest.mark.slow
def test_smoke_passes_with_packing(project):
    with _session(project, tokenize={"pack": True}) as session:
        session.run(pipeline_names=["smoke"])
    report = json.loads((project / "data" / "08_reporting" / "tokenize_report.json").read_text())["train"]
    assert report["packed"] and report["padding_efficiency"] > report["padding_efficiency_unpacked"]
    assert json.loads((project / "data" / "08_reporting" / "smoke_report.json").read_text())["passed"]
