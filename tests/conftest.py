"""Test set-up: a fake 8-device CPU mesh, no telemetry, and throwaway project copies."""

import os

# Before JAX is imported anywhere: 8 fake CPU devices (fsdp=4 x tp=2 meshes).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
os.environ.pop("MLFLOW_TRACKING_URI", None)

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def copy_project(dest: Path) -> Path:
    """The project's config, raw data and metadata in `dest`, to run Kedro there."""
    shutil.copytree(ROOT / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    (dest / "conf" / "local").mkdir()
    shutil.copytree(ROOT / "data" / "01_raw", dest / "data" / "01_raw")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    shutil.copy(ROOT / ".telemetry", dest / ".telemetry")
    (dest / "src").mkdir()  # Kedro wants a source folder; the package itself is installed
    return dest


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A fresh copy of the project as the working directory (relative paths resolve there)."""
    path = copy_project(tmp_path / "project")
    monkeypatch.chdir(path)
    return path


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
