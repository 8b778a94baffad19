"""A terminal worth reading (`tunix_pipeline.run.quiet`), and what one smoke run records in MLflow."""

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import mlflow
import pytest
import yaml

from tunix_pipeline.run import quiet

KEDRO = str(Path(sys.executable).parent / "kedro")

# Every record reaches the root handler, with its level, logger and file: MLflow's and transformers'
# loggers otherwise print through handlers of their own (MLFLOW_CONFIGURE_LOGGING, CI).
PLAIN_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "LOG|%(levelname)s|%(name)s|%(pathname)s|%(message)s"}},
    "handlers": {"plain": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
    "root": {"handlers": ["plain"], "level": "INFO"},
}
LOG_LINE = re.compile(r"^LOG\|(WARNING|ERROR|CRITICAL)\|([^|]*)\|([^|]*)\|(.*)$")
PY_WARNING = re.compile(r"^(\S+?):(\d+): (\w*Warning): (.*)$")


def upstream_complaints(output: str) -> list[str]:
    """Python warnings and WARNING (or worse) log lines in `output` that do not come from the project."""
    found = []
    for line in output.splitlines():
        if (m := LOG_LINE.match(line)) and not m.group(2).startswith("tunix_pipeline"):
            found.append(line)
        elif (m := PY_WARNING.match(line)) and "/tunix_pipeline/" not in m.group(1):
            found.append(line)
    return found


def test_each_listed_line_is_dropped_only_from_its_own_module():
    for known in quiet.LOG_LINES:
        logger = logging.getLogger(known.logger)
        quiet.install()
        quiet.install()  # twice: one filter per logger
        assert sum(isinstance(f, quiet._DropKnown) for f in logger.filters) == 1

        def record(path, message):
            return logger.makeRecord(known.logger, logging.WARNING, path, 1, message, None, None)

        assert not logger.filter(record(f"/site-packages/{known.path}", known.message)), known
        assert logger.filter(record("/site-packages/other/module.py", known.message)), "another module says it"
        # another text: for a line matched by its start, one that starts otherwise; else one that says more
        other = "Not " + known.message if known.prefix else known.message + " (and more)"
        assert logger.filter(record(f"/site-packages/{known.path}", other)), "another text"
        if known.prefix:
            assert not logger.filter(record(f"/site-packages/{known.path}", known.message + " (and more)")), known
    for known in quiet.WARNINGS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.install()
            warnings.warn_explicit(known.message, known.category, "x.py", 1, module=known.module)
            warnings.warn_explicit(known.message, known.category, "x.py", 1, module="some.other.module")
            warnings.warn_explicit(known.message + "!", known.category, "x.py", 1, module=known.module)
        assert [str(w.message) for w in caught] == [known.message, known.message + "!"], known
    assert all(entry.reason for entry in (*quiet.LOG_LINES, *quiet.WARNINGS))


# transformers imported as if torch were not installed (it is in the test extra)
WITHOUT_TORCH = """
import importlib.util, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else find_spec(name, *a, **k)
sys.modules["torch"] = None
if sys.argv[1] == "quiet":
    from tunix_pipeline.run import quiet
    quiet.install()
import transformers
"""


@pytest.mark.parametrize("mode", ["loud", "quiet"])
def test_transformers_without_torch_is_quiet_once_installed(mode):
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, mode], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("PyTorch was not found" in result.stderr) == (mode == "loud"), result.stderr[-3000:]


def test_the_complaint_parser_sees_what_it_should():
    output = "\n".join([
        "LOG|WARNING|absl|/x/tunix/models/foo.py|something new",
        "LOG|WARNING|tunix_pipeline.run.hooks|/x/hooks.py|our own warning",
        "LOG|INFO|mlflow.store|/x/y.py|info is fine",
        "/x/site-packages/lib/mod.py:12: FutureWarning: going away",
        "/x/src/tunix_pipeline/mod.py:3: UserWarning: ours",
        "WARNING: Logging before InitGoogle() is written to STDERR",  # C++ (libtpu): no Python record
    ])
    assert upstream_complaints(output) == [
        "LOG|WARNING|absl|/x/tunix/models/foo.py|something new",
        "/x/site-packages/lib/mod.py:12: FutureWarning: going away",
    ]


@pytest.mark.slow
def test_smoke_run_terminal_is_quiet_and_its_mlflow_run_is_complete(project):
    (project / "plain_logging.yml").write_text(yaml.safe_dump(PLAIN_LOGGING))
    env = {**os.environ, "KEDRO_LOGGING_CONFIG": str(project / "plain_logging.yml"),
           "MLFLOW_CONFIGURE_LOGGING": "false", "CI": "true"}
    # system metrics every second, so that the smoke run's short trainings get samples
    command = [KEDRO, "run", "--pipelines=smoke", "--params", "tracking.system_metrics.interval_s=1"]
    result = subprocess.run(command, cwd=project, capture_output=True, text=True, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "LOG|INFO|tunix_pipeline.run.hooks|" in output, "the plain logging configuration was not used"
    complaints = upstream_complaints(output)
    assert not complaints, "unlisted upstream warnings (add each to tunix_pipeline/quiet.py with its reason, " \
        "or fix the cause):\n" + "\n".join(complaints)

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id])[0]
    run_id, tags = run.info.run_id, run.data.tags
    assert run.info.run_name == "smoke@gpu_smoke" and tags["kedro.env"] == "gpu_smoke"  # no --env: the smoke run's
    assert tags["kedro_command"] == "kedro run --pipelines=smoke --params tracking.system_metrics.interval_s=1"

    # the splits as MLflow datasets: source file, digest, schema, rows, and the sources they came from
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"train_records", "eval_records"}
    for name, context in (("train_records", "training"), ("eval_records", "evaluation")):
        dataset, input_tags = inputs[name].dataset, {t.key: t.value for t in inputs[name].tags}
        rows = (project / "data" / "02_intermediate" / f"{name}.jsonl").read_text().splitlines()
        assert json.loads(dataset.profile)["num_rows"] == len(rows)
        assert json.loads(dataset.source) == {"uri": (project / "data" / "02_intermediate" / f"{name}.jsonl").as_uri()}
        assert "answer" in dataset.schema and len(dataset.digest) == 16
        assert input_tags["mlflow.data.context"] == context
        assert input_tags["origin.arith_gsm8k"] == "data/01_raw/arith_gsm8k.jsonl"
    assert inputs["train_records"].dataset.digest != inputs["eval_records"].dataset.digest

    # the resolved configuration and the package versions
    config = yaml.safe_load(Path(client.download_artifacts(run_id, "config/parameters.yml")).read_text())
    assert config["sft"]["max_steps"] == 200 and config["tracking"]["system_metrics"]["interval_s"] == 1
    packages = json.loads(Path(client.download_artifacts(run_id, "config/packages.json")).read_text())["packages"]
    assert {"jax", "google-tunix", "transformers", "mlflow", "kedro"} <= set(packages)
    assert tags["config.digest"]

    # system metrics while training, measurements as metrics and configuration as parameters
    assert client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    assert run.data.params["sft_result.mesh.fsdp"] == "4" and "sft_result.mesh.fsdp" not in run.data.metrics
    assert run.data.params["sft.max_steps"] == "200" and "sft_result.latest_step" in run.data.metrics
    assert run.data.params["grpo_result.rewards.answer"] == "2.0" and "grpo_result.rewards.answer" not in run.data.metrics

    # the exported model, registered with the run's lineage, loads back as a transformers pipeline
    version = client.search_model_versions("name='tunix_pipeline'")[0]
    assert (version.version, version.run_id, tags["registered_model"]) == (1, run_id, "models:/tunix_pipeline/1")
    assert version.tags["kedro.env"] == "gpu_smoke" and version.tags["stage"] == "grpo"
    assert version.tags["config.digest"] == tags["config.digest"]
    mlflow.set_tracking_uri(f"sqlite:///{project / 'data' / 'mlflow.db'}")
    try:
        generate = mlflow.transformers.load_model("models:/tunix_pipeline/1")
    finally:
        mlflow.set_tracking_uri(None)  # also unsets MLFLOW_TRACKING_URI, which later runs would inherit
    text = generate("Ada has 3 apples.", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("Ada has 3 apples.")
