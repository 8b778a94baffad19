"""A run never hangs and an interrupt never loses work: Ctrl-C saves like SIGTERM and prints one line, one run writes
into an output root at a time, Orbax's waits are bounded. (SIGTERM's save and bitwise resume: tests/test_training.py.)"""

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tunix_pipeline.run import output_lock
from tunix_pipeline.run.output_lock import OutputRootBusy, acquire

from .conftest import KEDRO, PLAIN_LOGGING

LONG = "sft.max_steps=100000,sft.checkpoint_every=100000"  # trains until stopped; no save but the stop's


def _wait_for_line(path, pattern: str, process: subprocess.Popen, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        assert process.poll() is None, path.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s: {path.read_text()[-3000:]}")


@pytest.mark.slow
def test_ctrl_c_saves_says_so_in_one_line_and_the_same_command_resumes(smoke_run, tmp_path, monkeypatch):
    """A user's Ctrl-C mid-SFT (its own MLflow store: a copy of the shared smoke run without it); meanwhile a second
    run into the same output root stops before its first node, naming the first."""
    project = tmp_path / "project"
    shutil.copytree(smoke_run.project, project, ignore=shutil.ignore_patterns("mlflow.db", "mlruns", "mlflow_run.json"))
    (tmp_path / "logging.yml").write_text(json.dumps(PLAIN_LOGGING))
    env = {**os.environ, "KEDRO_LOGGING_CONFIG": str(tmp_path / "logging.yml"), "MLFLOW_CONFIGURE_LOGGING": "false"}
    command = [KEDRO, "run", "--pipelines=sft", "--params", LONG]
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(command, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_line(log, r"sft: step 20\d/100000", first)

        second = subprocess.run([KEDRO, "run", "--pipelines=sft"], cwd=project, env=env, capture_output=True,
                                text=True, timeout=300)
        errors = [line for line in second.stderr.splitlines() if line.startswith("Error:")]
        assert second.returncode == 1 and len(errors) == 1, second.stderr[-3000:]
        assert f"is in use by another run (pid {first.pid} on {socket.gethostname()}" in errors[0], errors
        assert "kedro run --pipelines=sft --params " + LONG in errors[0], errors
        assert "Running node" not in second.stderr and "Traceback" not in second.stderr, second.stderr[-3000:]

        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=120) == 128 + signal.SIGINT, log.read_text()[-3000:]
    finally:
        first.kill()
    output = log.read_text()
    assert "Traceback" not in output, output[-6000:]
    assert "failed with error" not in output and "have not run" not in output, output[-3000:]  # said once, below
    stop = re.findall(r"^SIGINT: saved a checkpoint at step (\d+) in (\S+); resume with: (.+)$", output, re.M)
    assert len(stop) == 1, output[-3000:]
    step, folder, resume = int(stop[0][0]), stop[0][1], stop[0][2]
    assert step > 200 and resume == "kedro run --pipelines=sft --params " + LONG
    ckpt_dir = project / "data" / "06_models" / "sft_checkpoints"
    assert folder == str(ckpt_dir) and (ckpt_dir / str(step)).is_dir()
    assert not (project / "data" / output_lock.LOCK_FILE).exists()

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id])[0]
    assert run.info.status == "KILLED"
    assert (run.data.tags["stopped.signal"], run.data.tags["stopped.step"]) == ("SIGINT", str(step))

    # the same stage resumes from the step Ctrl-C saved (two steps more here, not 100000)
    monkeypatch.chdir(project)
    bootstrap_project(project)
    with KedroSession.create(project_path=project, runtime_params={"sft": {"max_steps": step + 2}}) as session:
        session.run(pipeline_names=["sft"])
    resumed = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    assert (resumed["resumed_from_step"], resumed["latest_step"]) == (step, step + 2)
    assert not (project / "data" / output_lock.LOCK_FILE).exists()


def test_the_output_root_lock_names_its_holder_and_is_taken_over_once_it_is_gone(tmp_path, caplog):
    lock = acquire(tmp_path, "kedro run --pipelines=sft")
    holder = json.loads((tmp_path / output_lock.LOCK_FILE).read_text())
    assert (holder["pid"], holder["host"], holder["command"]) == (os.getpid(), socket.gethostname(),
                                                                   "kedro run --pipelines=sft")
    lock.release()
    assert not (tmp_path / output_lock.LOCK_FILE).exists()

    def held_by(**holder) -> None:
        (tmp_path / output_lock.LOCK_FILE).write_text(json.dumps({"command": "kedro run", "started": time.time(),
                                                                 "host": socket.gethostname(), **holder}))

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held_by(pid=sleeper.pid)
        with pytest.raises(OutputRootBusy, match=rf"in use by another run \(pid {sleeper.pid} on "):
            acquire(tmp_path, "kedro run")
    finally:
        sleeper.kill()
        sleeper.wait()
    with caplog.at_level("WARNING", logger=output_lock.__name__):
        acquire(tmp_path, "kedro run").release()  # its process has ended
    assert f"process {sleeper.pid} has ended" in caplog.text

    held_by(pid=1, host="another-host")  # on another host: held while it is refreshed
    with pytest.raises(OutputRootBusy, match="another-host"):
        acquire(tmp_path, "kedro run")
    old = time.time() - output_lock.STALE_SECONDS - 60
    os.utime(tmp_path / output_lock.LOCK_FILE, (old, old))
    acquire(tmp_path, "kedro run").release()
    assert "not refreshed for" in caplog.text


def test_a_read_that_never_finishes_is_given_up_within_its_limit(monkeypatch):
    """Orbax's saves and restores run through `run_sync`: a coroutine that never completes, and ignores being
    cancelled, fails with a TimeoutError after `IO_SECONDS` and holds the run no longer than `LEFTOVER_SECONDS` more."""
    from orbax.checkpoint._src import asyncio_utils

    from tunix_pipeline.upstream import event_loops, loops_finish_their_tasks

    monkeypatch.setattr(event_loops, "IO_SECONDS", 1.0)
    monkeypatch.setattr(event_loops, "LEFTOVER_SECONDS", 1.0)
    loops_finish_their_tasks()

    async def read_that_never_finishes():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        asyncio_utils.run_sync(read_that_never_finishes())
    assert time.monotonic() - started < 5


def test_a_second_ctrl_c_stops_at_once_and_grpo_prompts_end_on_a_stop(tmp_path):
    import pandas as pd

    from tunix_pipeline.train.grpo import PromptFeed
    from tunix_pipeline.train.loop import stop_on_signals

    feed = PromptFeed(pd.DataFrame({"prompt": [f"p{i}" for i in range(8)]}), batch_size=2, seed=0)
    batches = iter(feed)
    next(batches)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop_on_signals(feed):
        os.kill(os.getpid(), signal.SIGINT)  # the first: the run saves at the next step
        time.sleep(0.1)
        assert feed.stop_reason == "SIGINT" and feed.interrupted
        assert next(batches, None) is None  # GRPO's learner sees its prompts end, saves and closes
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second, while saving: at once
            time.sleep(1)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # the handlers are back


def test_jax_is_not_sent_probing_for_a_tpu_that_is_not_there():
    """With libtpu installed (the test extra) on a machine without a TPU, JAX's start printed libtpu's `E0000 ...
    unexpected worker hostname` line; the project's settings leave JAX the CPU there."""
    pytest.importorskip("libtpu")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES")}
    code = "import tunix_pipeline.settings, jax; print(jax.default_backend())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "cpu", done.stderr[-3000:]
    assert "worker hostname" not in done.stderr and "E0000" not in done.stderr, done.stderr[-3000:]


BARRIER_ALONE = """
import sys, time
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from tunix_pipeline.core.processes import ProcessesOutOfStep, barrier
if jax.process_index() == 1:
    time.sleep(6)  # arrives too late
    sys.exit(0)
started = time.monotonic()
try:
    barrier("end_of_sft", seconds=2)
except ProcessesOutOfStep as err:
    print(f"{time.monotonic() - started:.1f}|{err}")
"""


@pytest.mark.slow
def test_a_multi_host_barrier_that_another_process_never_reaches_ends_within_its_limit():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    late = subprocess.Popen([sys.executable, "-c", BARRIER_ALONE, address, "1"], env=env)
    try:
        first = subprocess.run([sys.executable, "-c", BARRIER_ALONE, address, "0"], env=env, capture_output=True,
                               text=True, timeout=120)
    finally:
        late.kill()
        late.wait()
    seconds, message = first.stdout.strip().splitlines()[-1].split("|", 1)
    assert float(seconds) < 5, first.stdout
    assert message.startswith("waited 2 s at 'end_of_sft' for the other processes of this multi-host run"), message
