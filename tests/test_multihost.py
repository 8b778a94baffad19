"""The whole default DAG as two `kedro run` processes of 4 CPU devices joined by `runtime.distributed`.

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
from pathlib import Path

import mlflow
import pytest

from .conftest import copy_project

KEDRO = str(Path(sys.executable).parent / "kedro")
# the shortest run that still goes through every stage: SFT, evaluation, one GRPO step, export
SHORT = ("sft.max_steps=4,sft.warmup_steps=1,sft.checkpoint_every=2,grpo.max_steps=1,"
         "grpo.max_completion_length=16,evaluate.num_prompts=8,evaluate.max_new_tokens=16,preference.enabled=false")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kedro(project: Path, devices: int, params: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([KEDRO, "run", *args, "--params", params], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(*processes: subprocess.Popen) -> None:
    logs = [p.communicate(timeout=600)[0] for p in processes]
    assert [p.returncode for p in processes] == [0] * len(processes), "\n\n".join(log[-4000:] for log in logs)


@pytest.mark.slow
def test_two_kedro_processes_run_the_whole_dag_and_export_what_one_process_exports(tmp_path):
    project = copy_project(tmp_path / "project")
    shared = tmp_path / "shared"
    port = _free_port()
    common = (f"{SHORT},sft.checkpoint_dir={shared}/sft,grpo.checkpoint_dir={shared}/grpo,"
              f"tracking.tracking_uri=sqlite:///{shared}/mlflow.db")
    _finish(*[
        _kedro(project, 4, f"{common},runtime.output_root={tmp_path}/host{i},"
               f"runtime.distributed.coordinator_address=127.0.0.1:{port},"
               f"runtime.distributed.num_processes=2,runtime.distributed.process_id={i}")
        for i in range(2)
    ])

    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    exported = json.loads((host0 / "06_models" / "exported_model.json").read_text())
    assert (exported["stage"], exported["checkpoint_step"]) == ("grpo", 1)
    # only process 0 writes the export; the other process went through the same node with it
    assert (host0 / "06_models" / "exported" / "model.safetensors").is_file()
    assert not (host1 / "06_models" / "exported").exists()
    assert json.loads((host1 / "06_models" / "exported_model.json").read_text())["stage"] == "grpo"
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{shared}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FINISHED"]

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


# process 0 fails to write: both processes leave the call failing, neither goes on alone
ON_MAIN = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from tunix_pipeline.config import DistributedParams
from tunix_pipeline.runtime import initialize_distributed, on_main_process
initialize_distributed(DistributedParams(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2])))
print("wrote:", on_main_process("demo", lambda: "done"))
def fail():
    raise OSError("disk full")
on_main_process("demo", fail)
"""


def test_a_write_that_fails_on_process_0_fails_every_process():
    address = f"127.0.0.1:{_free_port()}"
    workers = [subprocess.Popen([sys.executable, "-c", ON_MAIN, address, str(i)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in range(2)]
    first, second = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [1, 1], first + second
    assert "wrote: done" in first and "wrote: None" in second  # process 0 alone ran it
    assert "OSError: disk full" in first
    assert "RuntimeError: demo: failed on process 0" in second
