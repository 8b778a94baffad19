"""The plan's bytes on disk (planning/disk.py) and the final weights a scratch-checkpoint session saves
(final_weights.py): figures for Gemma-2B, the volumes' verdicts, and a short real run measured with `du`."""

import json
import subprocess
from pathlib import Path

import pytest

from tunix_pipeline.config import ExportParams, HardwareProfile, ModelParams, TrackingParams
from tunix_pipeline.config.training import CheckpointSettings, OptimizerSettings
from tunix_pipeline.models.architecture import from_hf_config
from tunix_pipeline.planning.disk import check, kept, location, plan_disk
from tunix_pipeline.planning.memory import TrainSetup
from tunix_pipeline.train.final_weights import copy_final_weights, keep_for_next_session

GEMMA_2B = {"model_type": "gemma", "vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384,
            "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
            "tie_word_embeddings": True}
KAGGLE = HardwareProfile(kind="tpu", devices=8, memory_gib=16, peak_tflops=197, disk_gb=73, saved_output_gb=20,
                         disk_source="Kaggle")


class Section(OptimizerSettings, CheckpointSettings):
    learning_rate: float = 1e-5


def _tracking(register=True):
    return TrackingParams(log_outputs=[], register_model={"enabled": register})


def _plan(root, checkpoint_dir, keep=3, mode="full", register=False):
    arch = from_hf_config(GEMMA_2B, "google/gemma-2b")
    setup = TrainSetup(per_device_batch=4, seq_len=1024, fsdp=8, param_dtype="bfloat16", mode=mode, lora_rank=16)
    model = ModelParams(source="google/gemma-2b", dtype="bfloat16")
    section = Section(checkpoint_dir=checkpoint_dir, checkpoint_every=40, keep_checkpoints=keep)
    export = ExportParams(output_dir=f"{root}/06_models/exported")
    return plan_disk(arch, setup, KAGGLE, [("s1", model, [("sft", section, 114)])], export, _tracking(register), root)


def _outputs(disk):
    return {o["what"]: o for o in disk["sessions"][0]["outputs"]}


def test_gemma_2b_full_bf16_checkpoint_is_weights_and_two_adam_moments(tmp_path):
    root = str(tmp_path / "working")
    disk = _plan(root, f"{root}/06_models/sft_checkpoints")
    ckpt = _outputs(disk)["sft checkpoints"]
    # 2.506e9 weights in bf16: 5.01 GB, AdamW's two moments 10.02 GB; 3 of the 3 saves (114 steps, every 40) kept
    assert ckpt["parts_gb"]["weights"] == pytest.approx(5.012, abs=0.01)
    assert ckpt["parts_gb"]["optimizer"] == pytest.approx(10.025, abs=0.01)
    assert ckpt["count"] == 3 and ckpt["gb"] == pytest.approx(45.1, abs=0.1) and ckpt["where"] == "saved"
    assert _outputs(disk)["export (HF safetensors, bfloat16)"]["gb"] == pytest.approx(5.03, abs=0.01)
    # 50 GB under /kaggle/working fits the 73 GB disk (with the hub's 5 GB and one checkpoint in flight), not the 20 saved
    assert disk["status"] == "warning" and disk["sessions"][0]["saved_gb"] == pytest.approx(50.1, abs=0.1)
    assert any("keep_checkpoints" in m and "20 GB is saved" in m for m in disk["messages"])


def test_float32_masters_with_a_bf16_first_moment_and_a_bf16_export(tmp_path):
    """tpu_full's layout: float32 weights (10.0 GB), AdamW's first moment in bf16 and its second in float32 (15.0 GB),
    the export cast to bf16 (5.0 GB)."""
    root = str(tmp_path / "working")
    arch = from_hf_config(GEMMA_2B, "google/gemma-2b")
    setup = TrainSetup(per_device_batch=4, seq_len=1024, fsdp=8, param_dtype="float32", compute_dtype="bfloat16")
    section = Section(checkpoint_dir=f"{root}/ckpt", checkpoint_every=40, keep_checkpoints=1, mu_dtype="bfloat16")
    export = ExportParams(output_dir=f"{root}/06_models/exported", dtype="bfloat16")
    disk = plan_disk(arch, setup, KAGGLE, [("s1", ModelParams(source="google/gemma-2b"), [("sft", section, 114)])],
                     export, _tracking(False), root)
    ckpt = _outputs(disk)["sft checkpoints"]
    assert ckpt["parts_gb"]["weights"] == pytest.approx(10.025, abs=0.01)
    assert ckpt["parts_gb"]["optimizer"] == pytest.approx(15.037, abs=0.01)
    assert _outputs(disk)["export (HF safetensors, bfloat16)"]["gb"] == pytest.approx(5.03, abs=0.01)


def test_checkpoints_on_scratch_save_only_the_final_weights(tmp_path):
    root = str(tmp_path / "working")
    disk = _plan(root, str(tmp_path / "temp" / "sft_checkpoints"), keep=2)
    out = _outputs(disk)
    assert out["sft checkpoints"]["where"] == "scratch"
    final = out["sft final weights (for the next session)"]
    assert final["where"] == "saved" and final["gb"] == pytest.approx(5.01, abs=0.01)  # no optimizer state
    s = disk["sessions"][0]
    assert s["saved_gb"] == pytest.approx(10.05, abs=0.02)  # final weights and the export
    # the disk's peak: the hub download, two checkpoints and a third in flight, the final weights, the export
    assert s["disk_peak_gb"] == pytest.approx(5.01 + 3 * 15.04 + 5.01 + 5.03, abs=0.1)
    assert disk["status"] == "ok" and not disk["messages"]


def test_a_lora_checkpoint_holds_the_adapters_and_their_moments_only(tmp_path):
    root = str(tmp_path / "working")
    ckpt = _outputs(_plan(root, f"{root}/ckpt", mode="lora"))["sft checkpoints"]
    assert ckpt["parts_gb"]["weights"] < 0.05 and ckpt["parts_gb"]["optimizer"] == pytest.approx(
        2 * ckpt["parts_gb"]["weights"], rel=3e-3)  # parts_gb: 4 decimals


def test_over_the_session_disk_is_over_and_says_what_to_change(tmp_path):
    root = str(tmp_path / "working")
    disk = _plan(root, f"{root}/ckpt", keep=3, register=True)
    small = KAGGLE.model_copy(update={"disk_gb": 50})
    status, messages = check(disk["sessions"], small, fresh_root=True)
    assert status == "over" and messages[0].startswith("disk: session 's1' writes")
    assert "sft checkpoints 45.1 GB (3 x 15.04)" in messages[0] and "scratch folder" in messages[0]


def test_where_bytes_count(tmp_path):
    root = str(tmp_path / "working")
    assert location(f"{root}/06_models/x", root) == "saved"
    assert location(str(tmp_path / "temp"), root) == "scratch"
    assert location("gs://bucket/run/ckpt", root) == "remote"
    assert location(str(tmp_path / "x"), "gs://bucket/run") == "scratch"
    assert kept(114, 40, 3, None) == 3 and kept(30, 40, 2, None) == 1 and kept(None, 40, 2, None) == 2
    assert kept(200, 10, 2, dev_eval=object()) == 3  # the best dev step beside the latest two


def test_sessions_on_a_persistent_disk_add_up(tmp_path):
    root = str(tmp_path / "working")
    arch = from_hf_config(GEMMA_2B, "google/gemma-2b")
    setup = TrainSetup(per_device_batch=4, seq_len=1024, fsdp=8, param_dtype="bfloat16")
    model = ModelParams(source="google/gemma-2b", dtype="bfloat16")
    sessions = [(name, model, [("sft", Section(checkpoint_dir=f"{root}/c/{name}", checkpoint_every=40,
                                                keep_checkpoints=2), 80)]) for name in ("a", "b")]
    vm = HardwareProfile(kind="tpu", devices=8, memory_gib=16, peak_tflops=197, disk_gb=100, disk_source="VM")
    disk = plan_disk(arch, setup, vm, sessions, ExportParams(output_dir=f"{root}/e"), _tracking(False), root)
    # 2 x (hub 5 + 2 x 15 + export 5) + one checkpoint in flight = 95 GB: fits 100; a third session would not
    assert disk["status"] == "ok" and not disk["volumes"]["fresh_root_each_session"]
    disk = plan_disk(arch, setup, vm, sessions + [("c", model, sessions[0][2])], ExportParams(output_dir=f"{root}/e"),
                     _tracking(False), root)
    assert disk["status"] == "over" and "the sessions together" in disk["messages"][0]


# ---------------------------------------------------------------------------- the final weights
def _fake_checkpoints(folder: Path, steps=(40, 80)):
    for step in steps:
        for part in ("model_params", "optimizer_state"):
            (folder / str(step) / part).mkdir(parents=True)
            (folder / str(step) / part / "data").write_bytes(b"x" * (100 if part == "model_params" else 200))
        (folder / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
    (folder / "loss_history.json").write_text(json.dumps([{"step": 1, "loss": 1.0}]))


def test_a_session_on_scratch_saves_its_final_weights_without_the_optimizer(tmp_path):
    scratch, root = tmp_path / "temp" / "sft" / "s1", tmp_path / "working"
    _fake_checkpoints(scratch)
    entry = keep_for_next_session({"checkpoint_dir": str(scratch), "step": 80, "run_id": "r"}, str(root), "s1")
    target = root / "06_models" / "final_weights" / "s1" / "sft"
    assert entry["checkpoint_dir"] == str(target) and entry["step"] == 80 and entry["scratch_checkpoint_dir"] == str(scratch)
    assert sorted(p.name for p in target.iterdir()) == ["80", "loss_history.json"]
    assert sorted(p.name for p in (target / "80").iterdir()) == ["_CHECKPOINT_METADATA", "model_params"]
    # GRPO's policy is what the next session starts from when the session ran it
    grpo = tmp_path / "temp" / "grpo" / "s1" / "actor"
    _fake_checkpoints(grpo, (4,))
    entry = keep_for_next_session({"checkpoint_dir": str(scratch), "step": 80, "grpo_checkpoint_dir": str(grpo),
                                   "grpo_step": 4}, str(root), "s1")
    assert entry["checkpoint_dir"] == str(scratch) and entry["grpo_checkpoint_dir"].endswith("final_weights/s1/grpo")


def test_checkpoints_under_the_root_or_a_uri_root_stay_where_they_are(tmp_path):
    root = tmp_path / "working"
    _fake_checkpoints(root / "ckpt")
    entry = {"checkpoint_dir": str(root / "ckpt"), "step": 80}
    assert keep_for_next_session(entry, str(root), "s1") == entry
    assert keep_for_next_session({"checkpoint_dir": str(tmp_path / "x"), "step": 1}, "gs://b/run", "s1")["checkpoint_dir"] == str(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no weights"):
        copy_final_weights(root / "ckpt", 7, tmp_path / "out")


# ---------------------------------------------------------------------------- a real run, measured
def _du(*paths: Path) -> int:
    """Apparent bytes, as `du -sb` counts them (block rounding is noise for the tiny model's small files)."""
    return sum(int(subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True, check=True).stdout.split()[0])
               for p in paths)


@pytest.mark.slow
def test_planned_bytes_match_du_after_a_short_real_run(project):
    """The tiny model trained 12 steps (checkpoints every 4, 2 kept), exported with GGUF and registered in MLflow;
    then the plan pipeline on the same parameters: every output within 10% of `du`, and the weights-only copy a
    next session starts from loads as the checkpoint does."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(project)
    params = {"sft": {"max_steps": 12, "warmup_steps": 0, "checkpoint_every": 4, "keep_checkpoints": 2},
              "grpo": {"enabled": False}, "preference": {"enabled": False},
              "export": {"formats": ["hf", "gguf"], "gguf_types": ["q8_0", "f16"]},
              "plan": {"xla_check": {"enabled": False}}}
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["ingest", "base_model", "format", "tokenize", "sft", "grpo", "export"])
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["plan"])
    data = project / "data"
    disk = json.loads((data / "08_reporting" / "plan.json").read_text())["disk"]
    assert "## Disk" in (data / "08_reporting" / "plan.md").read_text() and disk["status"] == "ok"
    planned = {o["what"]: o["bytes"] for o in disk["sessions"][0]["outputs"]}
    ckpt = data / "06_models" / "sft_checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["12", "8"]
    measured = {
        "sft checkpoints": _du(ckpt),
        "export (HF safetensors, float32)": _du(data / "06_models" / "exported"),
        "GGUF (q8_0, f16)": _du(data / "06_models" / "gguf"),
        "base model (tiny, built)": _du(data / "06_models" / "base_model"),
        "MLflow registered model (a copy of the export)": _du(*(data / "mlruns").glob("*/models/*/artifacts")),
    }
    assert set(measured) == set(planned)
    for what, bytes_ in measured.items():
        print(f"{what}: planned {planned[what]:,} bytes, du -sb {bytes_:,} ({planned[what] / bytes_ - 1:+.1%})")
        assert planned[what] == pytest.approx(bytes_, rel=0.10), (what, planned[what], bytes_)

    # the weights-only copy restores the same weights as the checkpoint it came from
    import jax
    import numpy as np
    from flax import nnx

    from tunix_pipeline.models import load_pretrained
    from tunix_pipeline.train.checkpoints import restore_latest

    copy = copy_final_weights(ckpt, 12, project / "final")
    assert not (copy / "12" / "optimizer_state").exists()
    assert _du(copy) == pytest.approx(planned["sft checkpoints"] / 2 / 3, rel=0.15)  # a third of a checkpoint
    a, b = (load_pretrained(data / "06_models" / "base_model")[0] for _ in range(2))
    assert restore_latest(a, ckpt) == 12 and restore_latest(b, copy) == 12
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_plan_over_its_disk_is_over_in_the_table_and_plan_json(tmp_path):
    import yaml

    from tunix_pipeline.config import PlanParams, RuntimeParams, SftParams, TokenizeParams
    from tunix_pipeline.planning import build_plan, markdown
    from tunix_pipeline.planning.disk import add_disk

    from .conftest import ROOT

    base = yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"]
    plan_params = PlanParams.model_validate({**base, "hardware": "kaggle-tpu-v5e-8", "xla_check": {"enabled": False}})
    model = ModelParams(source="google/gemma-2b", dtype="bfloat16")
    root = str(tmp_path / "working")
    sft = SftParams(max_steps=120, per_device_batch_size=4, learning_rate=2e-5, checkpoint_every=40, remat="decoder",
                    checkpoint_dir=f"{root}/06_models/sft_checkpoints", keep_checkpoints=3)
    plan = build_plan(model, sft, RuntimeParams(output_root=root), TokenizeParams(max_length=1024), plan_params)
    assert plan.status == "ok"
    hw = plan.selected.hw.model_copy(update={"disk_gb": 40})
    disk = plan_disk(plan.job.arch, plan.selected.setup, hw, [("this run", model, [("sft", sft, 120)])],
                     ExportParams(output_dir=f"{root}/06_models/exported"), _tracking(False), root)
    plan = add_disk(plan, disk)
    summary, text = plan.summary(), markdown(plan)
    assert plan.status == summary["status"] == "over" and summary["disk"]["saved_gb"] == pytest.approx(50.1, abs=0.1)
    assert "**does not fit its disk** (see Disk below); the memory fits" in text and "## Disk" in text
    assert "| this run | sft checkpoints | saved: " in text and "| 3 | 15.037 | 5.012 | 10.025 | 45.112 |" in text
    assert any(w.startswith("disk: session 'this run' writes 70.2 GB at its peak") for w in summary["warnings"])


@pytest.mark.slow
def test_a_session_on_scratch_checkpoints_hands_the_next_one_its_saved_weights(project, tmp_path):
    """Two sessions with sft.checkpoint_dir on a scratch folder outside the output root (Kaggle: /kaggle/temp beside
    /kaggle/working): the first saves its final weights under the root, the scratch folder is gone (a new machine),
    and the second starts from the saved copy."""
    import shutil

    import yaml
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from omegaconf import OmegaConf

    env = project / "conf" / "scratch_sessions"
    env.mkdir()
    scratch = tmp_path / "scratch"
    smoke = yaml.safe_load((project / "conf" / "gpu_smoke" / "parameters.yml").read_text())
    (env / "parameters.yml").write_text(yaml.safe_dump(OmegaConf.to_container(OmegaConf.merge(smoke, {
        "sft": {"max_steps": 8, "warmup_steps": 1, "checkpoint_every": 4, "keep_checkpoints": 2,
                "checkpoint_dir": str(scratch / "sft")},
        "plan": {"xla_check": {"enabled": False}}, "preference": {"enabled": False}, "grpo": {"enabled": False},
        "sessions": {"plan": [{"name": "s1", "hours": 6}, {"name": "s2", "hours": 6, "params": {"sft": {"max_steps": 4}}}]},
    }))))
    bootstrap_project(project)
    models = project / "data" / "06_models"

    def run():
        with KedroSession.create(project_path=project, env="scratch_sessions") as session:
            session.run(pipeline_names=["ingest", "base_model", "format", "tokenize", "sft"])
        return json.loads((models / "sft_result.json").read_text())

    first = run()
    assert first["checkpoint_dir"] == str(scratch / "sft" / "s1") and first["latest_step"] == 8
    ledger = json.loads((project / "data" / "sessions.json").read_text())["finished"]["s1"]
    assert ledger["checkpoint_dir"] == "06_models/final_weights/s1/sft" and ledger["step"] == 8
    saved = models / "final_weights" / "s1" / "sft"
    assert sorted(p.name for p in (saved / "8").iterdir()) == ["_CHECKPOINT_METADATA", "commit_success.txt", "model_params"]
    shutil.rmtree(scratch)  # the next session's machine has no scratch folder
    second = run()
    assert second["parent_checkpoint"] == str(saved.resolve()) and second["parent_step"] == 8
    assert (second["resumed_from_step"], second["latest_step"]) == (0, 4)
    assert second["first_loss"] < 0.9 * first["first_loss"]  # it starts from session 1's weights


def test_the_sft_preflight_stops_a_run_whose_outputs_do_not_fit_the_disk(tmp_path):
    import pandas as pd
    import yaml

    from tunix_pipeline.config import GrpoParams, PlanParams, PreferenceParams, RuntimeParams, SftParams, TokenizeParams
    from tunix_pipeline.pipelines.sft.nodes import check_sft_fits
    from tunix_pipeline.planning import DoesNotFit

    from .conftest import ROOT

    base = yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"]
    base["profiles"]["kaggle-tpu-v5e-8"]["disk_gb"] = 40  # a smaller disk than the 73 GB the run's 70 GB fit
    plan = PlanParams.model_validate({**base, "hardware": "kaggle-tpu-v5e-8", "xla_check": {"enabled": False}})
    root = str(tmp_path / "working")
    model = ModelParams(source="google/gemma-2b", dtype="bfloat16")
    sft = SftParams(max_steps=120, per_device_batch_size=4, learning_rate=2e-5, checkpoint_every=40, remat="decoder",
                    checkpoint_dir=f"{root}/06_models/sft_checkpoints", keep_checkpoints=3)
    stages = (PreferenceParams(), GrpoParams(max_steps=10), ExportParams(output_dir=f"{root}/e"), _tracking(False))
    rows = pd.DataFrame({"input_tokens": [[1] * 1024] * 4})
    with pytest.raises(DoesNotFit) as err:
        check_sft_fits({"path": "nowhere"}, rows, None, model, sft, RuntimeParams(output_root=root),
                       TokenizeParams(max_length=1024), plan, *stages)
    message = str(err.value)
    assert message.startswith("google/gemma-2b's outputs do not fit the disk of kaggle-tpu-v5e-8:")
    assert "writes 70.2 GB at its peak" in message and "keep_checkpoints" in message
    # on the profile's own 73 GB it goes on, warning that 50 GB under the output root is more than Kaggle saves
    plan = PlanParams.model_validate({**base, "hardware": "kaggle-tpu-v5e-8", "xla_check": {"enabled": False},
                                      "profiles": {**base["profiles"], "kaggle-tpu-v5e-8": {
                                          **base["profiles"]["kaggle-tpu-v5e-8"], "disk_gb": 73}}})
    _, summary = check_sft_fits({"path": "nowhere"}, rows, None, model, sft, RuntimeParams(output_root=root),
                                TokenizeParams(max_length=1024), plan, *stages)
    assert summary["status"] == "risky" and summary["disk"]["status"] == "warning"
