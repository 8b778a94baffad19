"""Checkpoints, the sessions ledger and the export on `gs://` URIs, through a local Cloud Storage
(tests/fake_gcs.py: TensorStore's HTTP API and fsspec's `gcs` protocol over one folder)."""

import json

import fsspec
import numpy as np
import pytest
from flax import nnx

from tunix_pipeline.config import ExportParams, FormatParams, ModelParams, RuntimeParams
from tunix_pipeline.models import load_model, load_pretrained
from tunix_pipeline.pipelines.export.nodes import export_model
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.run.sessions import Ledger, apply_current_session
from tunix_pipeline.train.checkpoints import restore_latest, start_from
from tunix_pipeline.train.sft import train

from . import fake_gcs
from .test_export import _rows
from .test_sessions import _params as session_params
from .test_training import MESH, _params, _sft


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """`gs://bucket` served from a local folder for this module; yields that folder."""
    root = tmp_path_factory.mktemp("gcs")
    (root / "bucket").mkdir()
    server = fake_gcs.serve(root)
    url = f"http://127.0.0.1:{server.server_port}"
    fake_gcs.BucketFolders.root = root
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TENSORSTORE_GCS_HTTP_URL", url)  # Orbax's arrays (TensorStore)
        env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test")
        env.setenv("STORAGE_EMULATOR_HOST", url)  # google-cloud-storage (Orbax's bucket lookup)
        for protocol in ("gs", "gcs"):  # epath (Orbax's other files, and ours) through fsspec
            fsspec.register_implementation(protocol, fake_gcs.BucketFolders, clobber=True)
        yield root / "bucket"
    server.shutdown()


def test_local_paths_resolve_and_uris_stay_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(storage_path("data/ckpt")) == str(tmp_path.resolve() / "data" / "ckpt")
    with pytest.raises(UserError, match=r"sft.checkpoint_dir: ftp://host/run is a ftp:// URI; use a local folder"):
        storage_path("ftp://host/run", "sft.checkpoint_dir")
    with pytest.raises(UserError, match=r"export.output_dir: s3://b/x needs s3fs"):
        storage_path("s3://b/x", "export.output_dir")


def test_every_location_setting_is_checked_with_its_section():
    """A location a stage would only reach hours in fails where its section validates, naming the setting."""
    from tunix_pipeline.config import GrpoParams, SftParams
    from tunix_pipeline.config.validation import ConfigError, validate_section

    with pytest.raises(ConfigError, match=r"; sft.init_from: ftp://host/run is a ftp:// URI; use a local"):
        validate_section({"sft": {"init_from": "ftp://host/run"}}, "sft", SftParams)
    with pytest.raises(ConfigError, match=r"^parameters: grpo.checkpoint_dir: s3://b/x needs s3fs"):
        validate_section({"grpo": {"checkpoint_dir": "s3://b/x"}}, "grpo", GrpoParams)
    with pytest.raises(ConfigError, match=r"^parameters: export.gguf_dir: az://b/x needs adlfs"):
        validate_section({"export": {"gguf_dir": "az://b/x"}}, "export", ExportParams)
    with pytest.raises(ConfigError, match=r"^parameters: runtime.output_root: ftp://h/x is a ftp:// URI"):
        validate_section({"runtime": {"output_root": "ftp://h/x"}}, "runtime", RuntimeParams)


@pytest.mark.slow
def test_sft_checkpoints_resume_restore_and_export_through_gs(bucket, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a mangled `gs:` folder would appear
    mesh = make_mesh(MESH)
    rows, uri = _rows(n=16, length=24), "gs://bucket/run/sft"
    model, _ = load_model(tiny_model_dir, mesh)
    first = train(model, rows, rows.head(0), _sft(tmp_path, max_steps=2, checkpoint_every=2, checkpoint_dir=uri), mesh)
    assert first["checkpoint_dir"] == uri and first["latest_step"] == 2
    assert (bucket / "run" / "sft" / "2" / "model_params").is_dir()  # written by Orbax (TensorStore and epath)
    assert not (tmp_path / "gs:").exists()

    # a rerun with a longer budget resumes from the bucket: steps, history and weights
    model, _ = load_model(tiny_model_dir, mesh)
    second = train(model, rows, rows.head(0), _sft(tmp_path, max_steps=3, checkpoint_every=2, checkpoint_dir=uri), mesh)
    assert (second["resumed_from_step"], second["latest_step"]) == (2, 3)
    assert [h["step"] for h in json.loads((bucket / "run" / "sft" / "loss_history.json").read_text())] == [1, 2, 3]
    fresh, _ = load_model(tiny_model_dir, mesh)
    assert restore_latest(fresh, storage_path(uri)) == 3
    trained, restored = _params(model), _params(fresh)
    assert all(np.array_equal(trained[k], restored[k]) for k in trained)  # a save/restore round trip: bitwise

    # sft.init_from a gs:// parent
    other, _ = load_model(tiny_model_dir, mesh)
    assert start_from(other, storage_path(uri), tmp_path / "child")["parent_step"] == 3
    assert np.array_equal(_params(other)["embedder.input_embedding"], trained["embedder.input_embedding"])

    # export.output_dir on gs://: written locally, then copied over the bucket folder (stale files removed)
    (bucket / "run" / "exported").mkdir(parents=True)
    (bucket / "run" / "exported" / "model-00001-of-00009.safetensors").write_bytes(b"an older export")
    out = export_model({"path": str(tiny_model_dir)}, ModelParams(source=str(tiny_model_dir)),
                       ExportParams(output_dir="gs://bucket/run/exported"), RuntimeParams(mesh={"fsdp": 4, "tp": 2}),
                       FormatParams(), sft_result={"checkpoint_dir": uri, "latest_step": 3},
                       preference_result={"enabled": False}, grpo_result={"enabled": False})
    assert out["path"] == "gs://bucket/run/exported" and out["checkpoint_step"] == 3
    assert not (bucket / "run" / "exported" / "model-00001-of-00009.safetensors").exists()
    exported, _ = load_pretrained(bucket / "run" / "exported")
    weights = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(exported, nnx.Param))}
    assert np.array_equal(weights["embedder.input_embedding"], trained["embedder.input_embedding"])


def test_sessions_ledger_and_previous_root_on_gs(bucket, tmp_path):
    root = "gs://bucket/sessions"
    Ledger(root).record_finished(0, "first", {"run_id": "r1", "checkpoint_dir": f"{root}/06_models/sft_checkpoints/first", "step": 10})
    # stored relative to the root (the bucket folder may be read from elsewhere), read back as a URI
    assert json.loads((bucket / "sessions" / "sessions.json").read_text())["finished"]["first"]["checkpoint_dir"] == (
        "06_models/sft_checkpoints/first"
    )
    assert apply_current_session(session_params(root))["sft"]["init_from"] == f"{root}/06_models/sft_checkpoints/first"
    # a fresh machine with a local output root continues from the bucket
    fresh = apply_current_session(session_params(tmp_path / "new", previous_root=root))
    assert fresh["sessions"]["current"]["name"] == "second"
    assert fresh["sft"]["init_from"] == f"{root}/06_models/sft_checkpoints/first"
