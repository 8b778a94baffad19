"""The restart rule on the smoke configuration (with packed rows), with real `kedro run`s: a rerun with
--only-missing-outputs continues the run it follows when that run did not finish and has the same environment and
configuration; otherwise it opens a new run tagged `lineage.restart_of`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

pytestmark = pytest.mark.slow

KEDRO = str(Path(sys.executable).parent / "kedro")
SMOKE = [KEDRO, "run", "--pipelines=smoke"]


def _runs(project):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id],
                                      order_by=["start_time DESC"])


def _kedro(project, *args):
    return subprocess.run([*SMOKE, *args], cwd=project, capture_output=True, text=True, env=os.environ)


def test_a_restart_continues_an_unfinished_run_or_opens_a_linked_one(project):
    # the smoke configuration with packing, for every run here: the finished run must pass the smoke checks with it
    (project / "conf" / "local" / "parameters_tokenize.yml").write_text("tokenize:\n  pack: true\n")
    # a smoke run stopped (kill -9, as a preemption) once SFT is done, while it evaluates
    victim = subprocess.Popen(SMOKE, cwd=project, env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sft_done = project / "data" / "06_models" / "sft_result.json"
    deadline = time.time() + 600
    while not sft_done.exists():
        assert victim.poll() is None and time.time() < deadline, "the run ended before SFT finished"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    assert not (project / "data" / "08_reporting" / "smoke_report.json").exists()
    client, runs = _runs(project)
    assert len(runs) == 1 and runs[0].info.status == "RUNNING"  # killed: never closed
    first = runs[0].info.run_id

    # same environment, same configuration, not finished: the restart continues it
    trained_at = sft_done.stat().st_mtime_ns
    rerun = _kedro(project, "--only-missing-outputs")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert sft_done.stat().st_mtime_ns == trained_at, "the finished nodes ran again"
    reporting = project / "data" / "08_reporting"
    assert json.loads((reporting / "smoke_report.json").read_text())["passed"]
    # packed rows: each step holds more tokens than padded rows would
    packing = json.loads((reporting / "tokenize_report.json").read_text())["train"]
    assert packing["packed"] and packing["padding_efficiency"] > packing["padding_efficiency_unpacked"]
    client, runs = _runs(project)
    assert [r.info.run_id for r in runs] == [first], "the restart should continue the stopped run"
    run = runs[0]
    assert run.info.status == "FINISHED" and "lineage.restart_of" not in run.data.tags
    assert run.data.tags["kedro_command"] == "kedro run --pipelines=smoke"  # the first command stays
    assert run.data.tags["kedro_restart_command"] == "kedro run --pipelines=smoke --only-missing-outputs"
    # the evaluation sits beside the training curves
    assert len(client.get_metric_history(first, "train/loss")) == 200
    assert {"eval_metrics.tuned.eval_loss", "grpo_eval_metrics.grpo.eval_loss", "smoke_report.loss_ratio"} <= set(run.data.metrics)

    # otherwise a new run, linked: (1) the run it follows finished
    again = _kedro(project, "--only-missing-outputs")
    assert again.returncode == 0, again.stderr[-3000:]
    client, runs = _runs(project)
    assert len(runs) == 2 and runs[0].data.tags["lineage.restart_of"] == first
    assert runs[0].info.status == "FINISHED"

    # (2) it did not finish, but its configuration differs: a run that fails in ingest, then a restart without its change
    (project / "conf" / "local" / "parameters.yml").write_text(
        "ingest:\n  sources:\n    - {name: missing, path: data/01_raw/nope.jsonl, format: gsm8k}\n"
    )
    failed = _kedro(project)
    assert failed.returncode != 0 and "file not found" in failed.stdout + failed.stderr
    (project / "conf" / "local" / "parameters.yml").unlink()
    client, runs = _runs(project)
    assert runs[0].info.status == "FAILED"
    failed_id = runs[0].info.run_id
    restart = _kedro(project, "--only-missing-outputs")
    assert restart.returncode == 0, restart.stderr[-3000:]
    client, runs = _runs(project)
    assert len(runs) == 4 and runs[0].data.tags["lineage.restart_of"] == failed_id
    assert runs[0].data.tags["config.digest"] != runs[1].data.tags["config.digest"]
    assert client.get_run(failed_id).info.status == "FAILED"
