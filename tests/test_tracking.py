"""MLflow pieces of `tunix_pipeline.tracking.mlflow_runs` on a real sqlite store: configuration, long values, the restart rule."""

import json
from pathlib import Path

import mlflow
import pytest
import yaml

from tunix_pipeline.config import TrackingParams
from tunix_pipeline.core.command import kedro_command
from tunix_pipeline.tracking import mlflow_runs


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    yield uri
    if mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(None)  # also unsets MLFLOW_TRACKING_URI, which the project's hooks read


PARAMS = {
    "sft": {"max_steps": 10, "learning_rate": 1e-4},
    "tracking": {"tracking_uri": "https://alice:s3cret@mlflow.example.com", "wandb": {"api_key": "abc"}},
    "huggingface": {"token": "hf_xyz", "empty_token": None},
    "ingest": {"sources": [{"name": "a", "path": "data/01_raw/a.jsonl"}]},
}


def test_the_resolved_configuration_never_holds_credentials():
    text = mlflow_runs.config_yaml(PARAMS)
    for secret in ("s3cret", "alice", "abc", "hf_xyz"):
        assert secret not in text
    config = yaml.safe_load(text)
    assert config["tracking"]["tracking_uri"] == "https://<redacted>@mlflow.example.com"
    assert config["huggingface"] == {"token": "<redacted>", "empty_token": None}
    assert config["sft"] == PARAMS["sft"] and config["ingest"] == PARAMS["ingest"]
    # the digest follows the configuration, not the order of its keys
    reordered = {k: PARAMS[k] for k in reversed(PARAMS)}
    assert mlflow_runs.config_digest(mlflow_runs.config_yaml(reordered)) == mlflow_runs.config_digest(text)
    changed = {**PARAMS, "sft": {**PARAMS["sft"], "max_steps": 11}}
    assert mlflow_runs.config_digest(mlflow_runs.config_yaml(changed)) != mlflow_runs.config_digest(text)


def test_a_long_parameter_or_tag_becomes_an_artifact(store, tmp_path):
    long_value = "x" * (mlflow_runs.MAX_PARAM_LENGTH + 1)
    long_tag = "y" * (mlflow_runs.MAX_TAG_LENGTH + 1)
    run = mlflow_runs.start_run(store, TrackingParams(experiment="t", log_outputs=[]), {"prompt": {"template": long_value}, "a": 1},
                             tags={"kedro_command": long_tag, "kedro.env": "local"}, run_name="p@local")
    mlflow_runs.end_run("FINISHED")
    client = mlflow.MlflowClient(store)
    data = client.get_run(run.info.run_id).data
    assert data.params["a"] == "1"
    assert data.params["prompt.template"] == f"<{len(long_value)} characters: artifact long_values/prompt.template.txt>"
    assert Path(client.download_artifacts(run.info.run_id, "long_values/prompt.template.txt")).read_text() == long_value
    assert data.tags["kedro_command"].startswith(f"<{len(long_tag)} characters")
    assert Path(client.download_artifacts(run.info.run_id, "long_values/kedro_command.txt")).read_text() == long_tag
    assert yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config/parameters.yml")).read_text())["a"] == 1
    versions = json.loads(Path(client.download_artifacts(run.info.run_id, "config/packages.json")).read_text())
    assert versions["packages"]["mlflow"] == mlflow.__version__


def test_the_restart_rule(store):
    client = mlflow.MlflowClient(store)
    params = TrackingParams(experiment="t", log_outputs=[])

    def run(status, env="local", config=PARAMS):
        started = mlflow_runs.start_run(store, params, config, tags={"kedro.env": env, "kedro_command": "kedro run"})
        mlflow.end_run(status=status)
        return started.info.run_id

    digest = mlflow_runs.config_digest(mlflow_runs.config_yaml(PARAMS))
    for status in ("FAILED", "KILLED", "RUNNING"):
        unfinished = run(status)
        assert mlflow_runs.restart_rule(store, unfinished, "local", digest) == (unfinished, {})
    finished = run("FINISHED")
    assert mlflow_runs.restart_rule(store, finished, "local", digest) == (None, {"lineage.restart_of": finished})
    other_env = run("FAILED", env="tpu_full")
    assert mlflow_runs.restart_rule(store, other_env, "local", digest) == (None, {"lineage.restart_of": other_env})
    other_config = run("FAILED", config={**PARAMS, "sft": {"max_steps": 99}})
    assert mlflow_runs.restart_rule(store, other_config, "local", digest) == (None, {"lineage.restart_of": other_config})
    assert mlflow_runs.restart_rule(store, "0" * 32, "local", digest) == (None, {})  # gone from the store

    # continuing keeps the first command and records the restart's
    unfinished = run("FAILED")
    mlflow_runs.start_run(store, params, PARAMS, tags={"kedro.env": "local", "kedro_command": "kedro run --to-nodes=x"},
                       run_id=unfinished)
    mlflow_runs.end_run("FINISHED")
    tags = client.get_run(unfinished).data.tags
    assert (tags["kedro_command"], tags["kedro_restart_command"], tags["resumed"]) == (
        "kedro run", "kedro run --to-nodes=x", "true")
    assert client.get_run(unfinished).info.status == "FINISHED"


def test_a_run_started_from_python_records_its_kedro_run_equivalent():
    command = kedro_command({
        "env": "gpu_smoke", "pipeline_names": ["sft", "evaluate"], "from_nodes": ["train_sft"],
        "only_missing_outputs": True, "extra_params": {"sft": {"max_steps": 5}},
    })
    assert command == ("kedro run --env=gpu_smoke --pipelines=sft,evaluate --from-nodes=train_sft "
                       "--only-missing-outputs --params=sft.max_steps=5")
    assert mlflow_runs.is_restart({"only_missing_outputs": True}) and mlflow_runs.is_restart({"to_nodes": ["x"]})
    assert not mlflow_runs.is_restart({"only_missing_outputs": False, "from_nodes": [], "to_nodes": None})


def test_a_hub_source_is_named_with_its_revision(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from tunix_pipeline.config import SourceParams

    def source(**hf):
        return SourceParams(name="s", format="gsm8k", hf=hf)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no hub here: the configured revision, or say so
    assert mlflow_runs._origin(source(path="openai/gsm8k", name="main", revision="e53f048")) == \
        "hf:openai/gsm8k[main]/train@e53f048"
    assert mlflow_runs._origin(source(path="openai/gsm8k", split="test")) == "hf:openai/gsm8k/test@unknown (offline)"
    assert mlflow_runs._origin(source(path=str(tmp_path))) == f"hf:{tmp_path}/train@local"  # a folder on disk
    assert mlflow_runs._origin(SourceParams(name="f", format="gsm8k", path="data/01_raw/a.jsonl")) == "data/01_raw/a.jsonl"
