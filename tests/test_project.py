"""The Kedro project as users run it: configuration, CLI, MLflow, kedro-viz."""

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import mlflow
import numpy as np
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tunix_pipeline.data.readers import DataError

from .conftest import copy_project

KEDRO = str(Path(sys.executable).parent / "kedro")


def _session(path, env=None, **runtime_params):
    bootstrap_project(path)
    return KedroSession.create(project_path=path, env=env, runtime_params=runtime_params or None)


def _runs(path):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{path / 'data' / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(experiments, order_by=["start_time DESC"])


ENVIRONMENTS = sorted(p.name for p in (Path(__file__).parents[1] / "conf").iterdir() if p.name not in ("base", "local"))


@pytest.mark.parametrize("env", [None, *ENVIRONMENTS])
def test_every_environment_validates(project, env):
    with _session(project, env) as session:
        params = session.load_context().params
    assert params["sft"].checkpoint_every > 0 and params["tokenize"].max_length > 8
    if env == "tpu_full":
        assert params["model"].source == "google/gemma-2b" and params["model"].dtype == "float32"  # masters
        assert params["tokenize"].max_length == 1024 and params["sft"].per_device_batch_size == 4
        assert (params["sft"].checkpoint_every, params["sft"].keep_checkpoints) == (40, 1)  # 25 GB: docs/plan.md, Disk
        assert params["sft"].optimizer == "adamw" and params["sft"].warmup_steps > 0
        assert params["runtime"].mesh == "auto"
        # only what differs is in the environment: base keys survive the merge
        assert params["evaluate"].temperature == 0
        # seed 000's week as a session plan: the first session, its own checkpoints and 9 h budget
        assert params["sessions"]["current"]["name"] == "sft_gsm8k" and params["sft"].time_budget_hours == 9
        assert params["sft"].checkpoint_dir == "/kaggle/temp/tunix/sft_checkpoints/sft_gsm8k"  # scratch: not saved


def test_a_wrong_key_fails_before_any_node_runs(project):
    from tunix_pipeline.config.validation import ConfigError

    (project / "conf" / "local" / "parameters.yml").write_text("sft:\n  max_step: 5\n")
    with _session(project) as session, pytest.raises(
            ConfigError, match=r"^parameters: sft.max_step: unknown setting; did you mean sft.max_steps\?$"):
        session.run(pipeline_names=["smoke"])
    assert not list((project / "data").glob("0[2-8]_*/*")), "a node ran before validation"


# a setting's mistake is found against the nodes' settings: Kedro loads every pipeline first (~12 s here)
LOADS_PIPELINES = pytest.mark.slow


@pytest.mark.parametrize(("args", "message"), [
    (["--env", "tpu_ful"], "unknown environment 'tpu_ful' (--env): conf/ has base, gemma3_270m_cpu, "),
    (["--env", "tpu_ful"], "; did you mean tpu_full?"),
    pytest.param(["--params", "sft.learning_rat=1e-4"], "parameters: sft.learning_rat: unknown setting; did you mean "
                 "sft.learning_rate?", marks=LOADS_PIPELINES),
    pytest.param(["--params", "runtime.mesh={fsd: 8}"],
                 "parameters: runtime.mesh.fsd: Input should be 'data', 'fsdp' or 'tp'", marks=LOADS_PIPELINES),
    # sessions is read by the config loader and the hooks only (no node takes it): their error is as short
    pytest.param(["--params", "sessions.weekly_hour=20"], "parameters: sessions.weekly_hour: unknown setting; did you "
                 "mean sessions.weekly_hours?", marks=LOADS_PIPELINES),
    pytest.param(["--env", "tpu_full", "--params", "grpo.max_steps=0"],
                 "parameters: grpo.max_steps: Input should be greater than 0 (got 0)", marks=LOADS_PIPELINES),
])
def test_a_user_mistake_is_one_line_without_a_traceback(project, args, message):
    result = subprocess.run([KEDRO, "run", "--pipelines=ingest", *args], cwd=project, capture_output=True, text=True,
                            env=os.environ)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "validation error for" not in result.stderr + result.stdout
    assert not list((project / "data").glob("0[2-8]_*/*")), "a node ran"


def test_conf_local_applies_over_any_environment_and_params_over_it(project):
    (project / "conf" / "local" / "parameters.yml").write_text("tracking:\n  experiment: mine\nsft:\n  seed: 7\n")
    (project / "conf" / "local" / "credentials.yml").write_text("huggingface:\n  token: hf_local\n")
    with _session(project, "tpu_full", sft={"seed": 9}) as session:
        context = session.load_context()
        params = context.params
        assert context.config_loader["credentials"]["huggingface"]["token"] == "hf_local"
    assert params["tracking"].experiment == "mine" and params["sft"].seed == 9
    assert params["model"].source == "google/gemma-2b"  # the environment's own settings stay


def test_an_environment_inherits_real_defaults_and_no_polish(tmp_path):
    """conf/base is what a user's environment starts from: the polish stages off, at learning rates and lengths
    for a pretrained model; the tiny model's sizes are the smoke run's (conf/gpu_smoke), never inherited."""
    from tunix_pipeline.settings import CONFIG_LOADER_ARGS

    project = copy_project(tmp_path / "project")
    (project / "conf" / "mine").mkdir()
    (project / "conf" / "mine" / "parameters.yml").write_text(
        "model:\n  source: google/gemma-3-1b-it\nsft:\n  learning_rate: 2.0e-5\n")
    with _session(project, "mine") as session:
        params = session.load_context().params
    assert CONFIG_LOADER_ARGS["default_run_env"] == "gpu_smoke"
    assert not params["preference"].enabled and not params["grpo"].enabled
    assert params["preference"].learning_rate == 5e-6 and params["grpo"].learning_rate == 1e-5
    assert params["preference"].max_response_length == 320 and params["grpo"].max_completion_length == 256
    assert params["runtime"].mesh == "auto" and params["sft"].warmup_steps == 0
    with _session(project) as session:  # no --env: the smoke run
        smoke = session.load_context().params
    assert smoke["preference"].enabled and smoke["preference"].learning_rate == 5e-4 and smoke["grpo"].enabled


@pytest.mark.slow
def test_a_failing_node_marks_the_mlflow_run_failed(project):
    (project / "conf" / "local" / "parameters.yml").write_text(
        "ingest:\n  sources:\n    - {name: missing, path: data/01_raw/nope.jsonl, format: gsm8k}\n"
    )
    with _session(project) as session, pytest.raises(DataError, match="file not found"):
        session.run(pipeline_names=["ingest"])
    _, runs = _runs(project)
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.tags["kedro.pipelines"] == "ingest"


@pytest.mark.slow  # a kedro run (or viz) in a process of its own
@pytest.mark.parametrize("flag", [["--pipeline", "ingest"], ["--pipelines=ingest"]])
def test_cli_runs_a_pipeline_with_either_flag(project, flag):
    result = subprocess.run([KEDRO, "run", *flag], cwd=project, capture_output=True, text=True, env=os.environ)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((project / "data" / "08_reporting" / "data_quality.json").read_text())
    assert report["totals"]["kept"] == 400
    _, runs = _runs(project)
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["data_quality_report.totals.rows_read"] == 400


@pytest.mark.slow  # a kedro run (or viz) in a process of its own
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


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_training_stage_starts_with_the_memory_earlier_nodes_freed_handed_back():
    """A run's nodes share one process, and each training stage starts with `runtime.hand_back_host_memory`
    (`RuntimeHooks`): a model an earlier stage left in a reference cycle is collected, and the blocks freed into
    glibc's heap go back to the system (in the GSM8K CPU recipe's whole DAG, GRPO then starts at 1.31 GiB resident
    instead of 3.25)."""
    from tunix_pipeline.core import runtime

    class Stage:
        pass

    stage = Stage()
    stage.itself, stage.weights = stage, np.ones(2**25, np.float32)  # 128 MiB held only by a cycle
    left = weakref.ref(stage)
    del stage
    kept, freed = [], []
    for _ in range(3000):  # 100 KB blocks come from glibc's heap (under its mmap threshold): 286 MiB of holes
        freed.append(np.full(25_000, 1.0, np.float32))
        kept.append(np.full(64, 1.0, np.float32))
    freed.clear()
    before = _resident_bytes()
    runtime.hand_back_host_memory()
    assert left() is None
    assert before - _resident_bytes() > 328 * 2**20  # both: the cycle's 128 MiB and most of the holes


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
