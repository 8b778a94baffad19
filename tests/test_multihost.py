"""The whole DAG, DPO included, as two `kedro run` processes of 4 CPU devices joined by `runtime.distributed`.

As on a pod: each process has its own output root (a worker's disk), the checkpoints and the
MLflow store are shared. Its export is compared with one process of 8 devices exporting the
same checkpoints: gathering the weights is pure data movement, so the files must be equal
byte for byte. (Not with a whole single-process run: one process of 8 devices and two of 4
compile the same train step, yet their updates already differ in the last bits after two
steps — and with a few SFT steps no completion earns a reward, so GRPO's only gradient is the
KL term, exactly zero at its first step and rounding noise in practice, which Adam scales to
learning-rate-sized steps. No tolerance on the weights follows from that; `test_training`
compares the loss curves of one and two processes.)
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import pytest

from tunix_pipeline.core.runtime import orbax_folders

from .conftest import ROOT, copy_project

KEDRO = str(Path(sys.executable).parent / "kedro")
# the shortest run that still goes through every stage: SFT, evaluation, DPO (`PREFERENCE`), one GRPO step, export
SHORT = ("sft.max_steps=4,sft.warmup_steps=1,sft.checkpoint_every=2,grpo.max_steps=1,"
         "grpo.max_completion_length=16,evaluate.num_prompts=8,evaluate.max_new_tokens=16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kedro(project: Path, devices: int, params: str, *args: str) -> subprocess.Popen:
    # wide enough that Rich does not wrap a log line
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "COLUMNS": "300"}
    # the log goes to a file, not a pipe: a pipe read one process after the other fills (64 KB) for the process read
    # second, which then blocks on a write while the first waits for it at JAX's shutdown barrier
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([KEDRO, "run", *args, "--params", params], cwd=project, env=env,
                               stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log
    return process


def _logs(*processes: subprocess.Popen, timeout: float = 600) -> list[str]:
    logs = []
    for p in processes:
        p.wait(timeout=timeout)
        p.log.seek(0)
        logs.append(p.log.read())
        p.log.close()
    return logs


def _finish(*processes: subprocess.Popen) -> list[str]:
    logs = _logs(*processes)
    assert [p.returncode for p in processes] == [0] * len(processes), "\n\n".join(log[-4000:] for log in logs)
    return logs


@pytest.mark.slow
def test_two_kedro_processes_run_the_whole_dag_with_dpo_and_export_what_one_process_exports(tmp_path):
    """Every stage as one global computation: SFT, DPO on pairs from a file, evaluation, one GRPO step, export; DPO's
    checkpoint written once into the shared folder and resumed by both processes."""
    project = copy_project(tmp_path / "project")
    shared = tmp_path / "shared"
    pairs = _pairs_file(tmp_path / "pairs.jsonl", 64)
    (project / "conf" / "local" / "parameters_preference.yml").write_text(
        PREFERENCE.replace("PAIRS", str(pairs)).replace("SHARED", str(shared)))
    common = (f"{SHORT},sft.checkpoint_dir={shared}/sft,grpo.checkpoint_dir={shared}/grpo,"
              f"tracking.tracking_uri=sqlite:///{shared}/mlflow.db")
    logs = _two_processes(project, common)

    checked = "grpo.checkpoint_dir, preference.checkpoint_dir, sft.checkpoint_dir: one folder on all 2 processes"
    assert all(checked in log for log in logs)
    assert not list(shared.glob("*/.shared-check-*"))  # the check's files are gone
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    _dpo_ran_as_one(host0, host1, shared)
    exported = json.loads((host0 / "06_models" / "exported_model.json").read_text())
    assert (exported["stage"], exported["checkpoint_step"]) == ("grpo", 1)
    # only process 0 writes the export; the other process went through the same node with it
    assert (host0 / "06_models" / "exported" / "model.safetensors").is_file()
    assert not (host1 / "06_models" / "exported").exists()
    assert json.loads((host1 / "06_models" / "exported_model.json").read_text())["stage"] == "grpo"

    # one process of 8 devices exports the same checkpoints (the two-process run's stage results)
    single = tmp_path / "single"
    for name in ("02_intermediate/base_model.json", "06_models/sft_result.json", "06_models/preference_result.json",
                 "06_models/grpo_result.json"):
        (single / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(host0 / name, single / name)
    _finish(_kedro(project, 8, f"runtime.output_root={single},tracking.enabled=false", "--pipelines=export"))
    one, two = single / "06_models" / "exported", host0 / "06_models" / "exported"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for path in one.iterdir():
        assert path.read_bytes() == (two / path.name).read_bytes(), path.name

    # both processes restore DPO's step 4 from the shared folder and go on to step 6
    first = json.loads((host0 / "06_models" / "preference_result.json").read_text())
    _two_processes(project, f"{common},preference.max_steps=6", "--from-nodes=run_preference",
                   "--to-nodes=run_preference")
    resumed = [json.loads((tmp_path / f"host{i}" / "06_models" / "preference_result.json").read_text())
               for i in range(2)]
    assert [(r["resumed_from_step"], r["latest_step"]) for r in resumed] == [(4, 6), (4, 6)]
    assert resumed[0]["history"][:4] == first["history"] and resumed[1]["history"] == resumed[0]["history"]


def _dpo_ran_as_one(host0: Path, host1: Path, shared: Path) -> None:
    results = [json.loads((host / "06_models" / "preference_result.json").read_text()) for host in (host0, host1)]
    first, other = results
    assert (first["processes"], first["mesh"], first["latest_step"]) == (2, {"data": 1, "fsdp": 4, "tp": 2}, 4)
    assert first["global_batch_size"] == 4  # a pair for each of the 4 data-parallel devices
    assert first["heldout_pair_accuracy_before"] == 0.5 and first["eval_pairs"] == 16
    # one global computation: every process reports the same losses, rewards and held-out accuracy, bit for bit
    assert other["history"] == first["history"] and len(first["history"]) == 4
    assert other["heldout_pair_accuracy"] == first["heldout_pair_accuracy"]
    assert first["history"][-1]["rewards/margin"] > 0
    metrics = [json.loads((host / "08_reporting" / "preference_eval_metrics.json").read_text()) for host in (host0, host1)]
    assert metrics[0]["preference"]["checkpoint_step"] == 4 and metrics[0]["preference"] == metrics[1]["preference"]
    # Orbax wrote each kept step once into the one shared folder; nothing half-written is left
    assert sorted(p.name for p in (shared / "preference").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert not [p for p in (shared / "preference").rglob("*") if "tmp" in p.name]
    # process 0 alone logs to MLflow: one run, finished, the held-out pair accuracy once before and once after
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{shared}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    accuracy = client.get_metric_history(run.info.run_id, "preference/eval/pair_accuracy")
    assert [(m.step, m.value) for m in accuracy] == [(0, 0.5), (4, first["heldout_pair_accuracy"])]


# process 0 fails to write: both processes leave the call failing, neither goes on alone
ON_MAIN = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from tunix_pipeline.config import DistributedParams
from tunix_pipeline.core.processes import on_main_process
from tunix_pipeline.core.runtime import initialize_distributed
initialize_distributed(DistributedParams(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2])))
print("wrote:", on_main_process("demo", lambda: "done"))
def fail():
    raise OSError("disk full")
on_main_process("demo", fail)
"""


def _two_scripts(script: str, *args: str) -> list[tuple[int, str, str]]:
    """`script` run as processes 0 and 1 of one JAX run (`sys.argv[1:3]`: the coordinator's address, the process id;
    then `args`): each one's exit status, standard output and standard error. The scripts' prints are read from
    standard output alone: Gloo's C++ log lines go to standard error, and there a write can land inside a line."""
    address = f"127.0.0.1:{_free_port()}"
    workers = [subprocess.Popen([sys.executable, "-c", script, address, str(i), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [w.communicate(timeout=120) for w in workers]
    return [(w.returncode, out, err) for w, (out, err) in zip(workers, outputs)]


def test_a_write_that_fails_on_process_0_fails_every_process():
    first, second = _two_scripts(ON_MAIN)
    assert [first[0], second[0]] == [1, 1], first + second
    assert "wrote: done" in first[1] and "wrote: None" in second[1]  # process 0 alone ran it
    assert "OSError: disk full" in first[2]
    assert "RuntimeError: demo: failed on process 0" in second[2]


# the checkpoint folders' check (runtime.check_shared_folders) on two processes: shared folders, local and
# on gs:// (both processes' `gs://` is one local folder, tests/fake_gcs.py), pass; a folder under each
# process's own root fails on both, with the same message, once the timeout is over
SHARED = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, sys.argv[4])
import fsspec
from tests.fake_gcs import BucketFolders
from tunix_pipeline.config import DistributedParams
from tunix_pipeline.core.runtime import FolderNotShared, check_shared_folders, initialize_distributed
root, pid = sys.argv[3], int(sys.argv[2])
BucketFolders.root = f"{root}/bucket"
for protocol in ("gs", "gcs"):
    fsspec.register_implementation(protocol, BucketFolders, clobber=True)
initialize_distributed(DistributedParams(coordinator_address=sys.argv[1], num_processes=2, process_id=pid))
check_shared_folders({"sft.checkpoint_dir": f"{root}/shared/sft", "grpo.checkpoint_dir": "gs://b/run/grpo"}, 10)
print("shared:", os.listdir(f"{root}/shared/sft"), os.listdir(f"{root}/bucket/b/run/grpo"))
start = time.monotonic()
try:
    check_shared_folders({"sft.checkpoint_dir": f"{root}/shared/sft", "grpo.checkpoint_dir": f"{root}/host{pid}/grpo"}, 2)
except FolderNotShared as err:
    print(f"after {time.monotonic() - start:.1f} s:", err)
"""


@pytest.mark.slow
def test_checkpoint_folders_are_checked_to_be_one_folder_on_every_process(tmp_path):
    runs = _two_scripts(SHARED, str(tmp_path), str(Path(__file__).parents[1]))
    assert [status for status, _, _ in runs] == [0, 0], runs
    errors = []
    for _, log, _ in runs:
        assert "shared: [] []" in log  # passed, and the marker files are gone
        seconds, _, error = log.split("after ")[1].partition(" s: ")
        assert 2 <= float(seconds) < 30  # the timeout, then the answer: no ten-minute wait
        errors.append(error.strip())
    assert errors[0] == errors[1]  # every process stops with the same message
    assert errors[0].startswith(
        f"these checkpoint folders are not one folder shared by every process of this multi-host run: "
        f"grpo.checkpoint_dir (process 0: {tmp_path}/host0/grpo, process 1: {tmp_path}/host1/grpo): "
        "process 1 did not see the file that process 0 wrote there within 2 s. "
    )
    assert "--params grpo.checkpoint_dir=/mnt/shared/run/grpo_checkpoints" in errors[0]
    assert "sft.checkpoint_dir (" not in errors[0]


def test_the_folders_checked_are_those_the_pipeline_writes_through_orbax():
    params = {"sft": {"checkpoint_dir": "s"}, "grpo": {"enabled": True, "checkpoint_dir": "g"},
              "preference": {"enabled": True, "checkpoint_dir": "p"}}
    assert orbax_folders(params, ["train_sft", "run_preference", "run_grpo", "export_model"]) == {
        "sft.checkpoint_dir": "s", "preference.checkpoint_dir": "p", "grpo.checkpoint_dir": "g"}
    params["preference"]["enabled"] = False
    assert orbax_folders(params, ["train_sft", "run_preference"]) == {"sft.checkpoint_dir": "s"}
    assert orbax_folders(params, ["ingest_sources", "evaluate_after_grpo"]) == {}  # nothing to check: no JAX set-up
    params["grpo"]["enabled"] = False
    assert orbax_folders(params, ["train_sft", "run_grpo"]) == {"sft.checkpoint_dir": "s"}


@pytest.mark.slow
def test_a_pod_whose_workers_keep_checkpoints_under_their_own_roots_stops_in_seconds(tmp_path):
    """Each process with its own output root, checkpoints left under it: the run stops before any node."""
    project = copy_project(tmp_path / "project")
    port = _free_port()
    start = time.monotonic()
    workers = [
        _kedro(project, 4, f"runtime.output_root={tmp_path}/host{i},runtime.shared_folder_timeout_s=5,"
               f"runtime.distributed.coordinator_address=127.0.0.1:{port},"
               f"runtime.distributed.num_processes=2,runtime.distributed.process_id={i}")
        for i in range(2)
    ]
    logs = _logs(*workers, timeout=300)
    elapsed = time.monotonic() - start
    assert [w.returncode for w in workers] == [1, 1], "\n\n".join(logs)
    for i, log in enumerate(logs):
        assert "Error: these checkpoint folders are not one folder shared by every process" in log, log[-3000:]
        assert f"grpo.checkpoint_dir (process 0: {tmp_path}/host0/06_models/grpo_checkpoints, process 1: " in log
        assert f"sft.checkpoint_dir (process 0: {tmp_path}/host0/06_models/sft_checkpoints, process 1: " in log
        assert "Traceback" not in log
        assert not (tmp_path / f"host{i}" / "02_intermediate").exists()  # no node ran
    assert elapsed < 180, elapsed  # start-up and 5 s, not Orbax's ten minutes


# the preference stage alone past a 2-step SFT: DPO on pairs from a file, 4 steps of a pair for each data-parallel device
PREFERENCE = """
preference:
  enabled: true
  method: dpo
  pairs: from_data
  data:
    sources: [{name: pairs, path: PAIRS, format: preference}]
    eval_fraction: 0.25
  max_prompt_length: 64
  max_response_length: 48
  per_device_batch_size: 1
  max_steps: 4
  learning_rate: 1.0e-3
  beta: 0.5
  checkpoint_dir: SHARED/preference
  checkpoint_every: 2
  keep_checkpoints: 2
"""


def _pairs_file(path: Path, rows: int) -> Path:
    """The project's arithmetic problems as pairs: the worked answer chosen, the same with a wrong result rejected."""
    lines = (ROOT / "data" / "01_raw" / "arith_gsm8k.jsonl").read_text().splitlines()[:rows]
    with path.open("w") as f:
        for record in map(json.loads, lines):
            work, result = record["answer"].rsplit("#### ", 1)
            wrong = f"{work}#### {int(result) + 1}"
            f.write(json.dumps({"prompt": record["question"], "chosen": record["answer"], "rejected": wrong}) + "\n")
    return path


def _two_processes(project: Path, params: str, *args: str) -> list[str]:
    port = _free_port()
    return _finish(*[
        _kedro(project, 4, f"{params},runtime.output_root={project.parent}/host{i},"
               f"runtime.distributed.coordinator_address=127.0.0.1:{port},"
               f"runtime.distributed.num_processes=2,runtime.distributed.process_id={i}", *args)
        for i in range(2)
    ])
