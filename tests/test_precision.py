"""Updates that land: the share of the trained weights a step can change in their dtype (planning.precision)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tunix_pipeline.planning import precision


def _normal_weights(scale: float = 0.02, n: int = 200_000):
    return np.random.default_rng(0).normal(0.0, scale, n).astype(np.float32)


def _direct_share(w: np.ndarray, dtype, step: float) -> float:
    """The share that actually changes: cast to `dtype`, add `step`, round back."""
    held = w.astype(dtype)
    return float(np.mean((held.astype(np.float32) + np.float32(step)).astype(dtype) != held))


def test_the_share_is_all_in_float32_and_low_in_bf16_at_2e5():
    m = precision.magnitudes_of([_normal_weights()], "N(0, 0.02)")
    assert precision.share_changed(m, "float32", 2e-5) == pytest.approx(1.0)
    bf16 = precision.share_changed(m, "bfloat16", 2e-5)
    assert 0.2 < bf16 < 0.4  # |w| ~ N(0, 0.02): only |w| < 2^-7 moves under 2e-5
    # the rule (half the spacing at |w|) matches rounding itself
    import ml_dtypes

    assert bf16 == pytest.approx(_direct_share(_normal_weights(), ml_dtypes.bfloat16, 2e-5), abs=0.01)
    assert precision.share_changed(m, "bfloat16", 1e-5) < bf16


def test_the_measured_gemma3_270m_figures():
    m = precision.GEMMA3_270M
    assert sum(m.binades.values()) == pytest.approx(1.0, abs=1e-4)
    assert precision.share_changed(m, "bfloat16", 2e-5) == pytest.approx(0.189, abs=0.002)
    assert precision.share_changed(m, "bfloat16", 1e-5) == pytest.approx(0.082, abs=0.002)
    assert precision.share_changed(m, "float32", 2e-6) == pytest.approx(1.0, abs=1e-4)


def test_the_warning_fires_below_the_threshold_with_the_fix():
    bf16 = precision.update_precision("bfloat16", None, "adamw", 2e-5, 10, "cosine", 114, warn_below=0.5)
    assert bf16["share_changed"]["peak"] < 0.5
    assert bf16["share_changed"]["end"] < bf16["share_changed"]["peak"]
    assert bf16["learning_rates"]["end"] == pytest.approx(2e-6)
    assert bf16["learning_rates"]["smallest"] == pytest.approx(2e-6)
    assert "model.dtype: float32" in bf16["warning"] and "sft.compute_dtype: bfloat16" in bf16["warning"]
    assert "LoRA" in bf16["warning"] and "stochastic rounding" in bf16["warning"] and "adafactor" in bf16["warning"]
    assert "assumed" in bf16["magnitudes"]
    # fp32 masters with bf16 compute: every weight can move
    masters = precision.update_precision("float32", "bfloat16", "adamw", 2e-5, 10, "cosine", 114, warn_below=0.5)
    assert masters["share_changed"]["peak"] == pytest.approx(1.0, abs=1e-4) and "warning" not in masters
    # the threshold is the setting: the same bf16 run above it is quiet
    assert "warning" not in precision.update_precision("bfloat16", None, "adamw", 2e-5, 10, "cosine", 114,
                                                       warn_below=0.1)


def test_lora_counts_the_adapters_in_their_dtype():
    lora = precision.update_precision("bfloat16", None, "adamw", 2e-5, 0, "constant", 100, lora=True,
                                      hidden_size=2048, warn_below=0.5)
    assert "LoRA" in lora["trained"]
    assert 0.5 <= lora["share_changed"]["peak"] < 1.0  # B (from zero) moves, most of A does not
    assert precision.update_precision("float32", None, "adamw", 2e-5, 0, "constant", 100, lora=True,
                                      hidden_size=2048)["share_changed"]["peak"] == pytest.approx(1.0)


def test_a_folder_of_safetensors_is_measured(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file

    w = _normal_weights().reshape(400, 500)
    # bf16 the way a hub checkpoint stores it: the top half of each float32, as uint16 bits
    save_file({"a.weight": w, "norm.weight": np.ones(500, np.float32)}, str(tmp_path / "model.safetensors"))
    measured = precision.weights_at_hand(tmp_path)
    assert measured is not None and measured.source.startswith("measured")
    expected = _direct_share(w, ml_dtypes.bfloat16, 2e-5)
    assert precision.share_changed(measured, "bfloat16", 2e-5) == pytest.approx(expected, abs=0.01)
    assert precision.weights_at_hand(tmp_path / "missing") is None


def test_the_plan_summary_and_markdown_carry_the_share(tmp_path):
    from tunix_pipeline.config import ModelParams, RuntimeParams, SftParams, TokenizeParams
    from tunix_pipeline.planning import build_plan, markdown

    from .test_planning import PLAN as plan
    model = ModelParams(source="google/gemma-2b", dtype="bfloat16", local_dir=str(tmp_path / "none"))
    sft = SftParams(max_steps=114, per_device_batch_size=4, learning_rate=2e-5, warmup_steps=10, checkpoint_every=40,
                    remat="decoder")
    result = build_plan(model, sft, RuntimeParams(mesh="auto"), TokenizeParams(max_length=1024),
                        plan.model_copy(update={"hardware": "kaggle-tpu-v5e-8", "xla_check": plan.xla_check.model_copy(
                            update={"enabled": False})}))
    summary = json.loads(json.dumps(result.summary(), default=str))
    share = summary["update_precision"]["share_changed"]["peak"]
    assert share < 0.5
    assert any("updates round away" in w for w in summary["warnings"])
    assert "Updates that land" in markdown(result) and f"{share:.1%}" in markdown(result)
    masters = build_plan(model.model_copy(update={"dtype": "float32"}), sft.model_copy(update={"compute_dtype": "bfloat16"}),
                         RuntimeParams(mesh="auto"), TokenizeParams(max_length=1024),
                         plan.model_copy(update={"hardware": "kaggle-tpu-v5e-8", "xla_check": plan.xla_check.model_copy(
                             update={"enabled": False})}))
    assert masters.summary()["update_precision"]["share_changed"]["peak"] == pytest.approx(1.0, abs=1e-4)
    assert not any("updates round away" in w for w in masters.warnings)


def test_the_sft_preflight_measures_the_base_model_and_warns(tmp_path, caplog):
    import logging

    import pandas as pd
    from safetensors.numpy import save_file

    from tunix_pipeline.config import ModelParams, RuntimeParams, SftParams, TokenizeParams
    from tunix_pipeline.pipelines.sft.nodes import check_sft_fits

    from .test_planning import PLAN

    # the base model's folder: config.json of Gemma-2B, a matrix of realistic magnitude as its safetensors
    (tmp_path / "config.json").write_text(json.dumps({**PLAN.architectures["google/gemma-2b"],
                                                       "architectures": ["GemmaForCausalLM"]}))
    save_file({"w": _normal_weights().reshape(400, 500)}, str(tmp_path / "model.safetensors"))
    plan = PLAN.model_copy(update={"hardware": "kaggle-tpu-v5e-8",
                                   "xla_check": PLAN.xla_check.model_copy(update={"enabled": False})})
    model = ModelParams(source="google/gemma-2b", dtype="bfloat16")
    sft = SftParams(max_steps=114, per_device_batch_size=4, learning_rate=2e-5, warmup_steps=10, checkpoint_every=40,
                    remat="decoder")
    rows = pd.DataFrame({"input_tokens": [[1] * 1024] * 32})
    logger = logging.getLogger("tunix_pipeline.pipelines.sft.nodes")
    logger.addHandler(caplog.handler)  # the project's logging config may stop propagation to the root
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            _, summary = check_sft_fits({"path": str(tmp_path)}, rows, None, model, sft, RuntimeParams(),
                                        TokenizeParams(max_length=1024), plan)
    finally:
        logger.removeHandler(caplog.handler)
    assert summary["update_precision"]["magnitudes"].startswith("measured")
    assert "updates round away" in caplog.text and "sft.compute_dtype: bfloat16" in caplog.text
    assert "a step can change" in caplog.text
