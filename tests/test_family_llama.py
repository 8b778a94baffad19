"""Llama 2 / 3 / 3.1 / 3.2 checkpoints: logits and greedy tokens equal to transformers', and export."""

from pathlib import Path

import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file

from tunix_pipeline.models import ModelError, load_model, read_hf_config
from tunix_pipeline.models.families import family_for

from .parity import assert_greedy_match, assert_logits_match, sample_batch, save_hf_model

# Llama 3.1's rope scaling, with a tiny original context so that it changes the tested positions
LLAMA31 = dict(
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
)


def _config(**overrides):
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        # weights large enough that attention is not near-uniform: a wrong rope shows in the logits
        initializer_range=0.2,
    )
    return transformers.LlamaConfig(**{**base, **overrides})


CASES = {
    "llama2_gqa": {},  # TinyLlama-style: rope theta 10000, untied head
    "mha_tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
    "llama31_gqa_theta500k": LLAMA31,
    "llama32_tied_mqa": {**LLAMA31, "tie_word_embeddings": True, "num_key_value_heads": 1},
    "linear_rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_llama_logits_match_transformers(tmp_path, overrides):
    folder = save_hf_model(_config(**overrides), tmp_path / "llama")
    tokens, mask = sample_batch(256)
    assert_logits_match(folder, tokens, mask)


def test_llama31_greedy_generation_matches_transformers(tmp_path):
    folder = save_hf_model(_config(**LLAMA31), tmp_path / "llama")
    assert_greedy_match(folder, sample_batch(256)[0][0, :5])


def assert_round_trip(folder: Path) -> None:
    """load_model -> flat Tunix params -> to_hf_state gives back exactly the saved tensors."""
    model, cfg = load_model(folder, None)
    params = {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    hf = read_hf_config(folder)
    ours = family_for(hf).to_hf_state(params, cfg, hf)
    saved = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        saved.update(load_file(f))
    assert sorted(ours) == sorted(saved)
    for key, tensor in saved.items():  # loading and exporting only copy and transpose: bitwise
        assert ours[key].shape == tensor.shape, key
        np.testing.assert_array_equal(ours[key], tensor, err_msg=key)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_export_round_trips_the_checkpoint(tmp_path, tied):
    assert_round_trip(save_hf_model(_config(tie_word_embeddings=tied), tmp_path / "llama"))


@pytest.mark.parametrize(
    "overrides, setting",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}, "rope_type='yarn'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
    ids=["dynamic_rope", "yarn_rope", "attention_bias", "mlp_bias", "gelu"],
)
def test_llama_refuses_unsupported_settings(overrides, setting):
    hf = _config(**overrides).to_dict()
    with pytest.raises(ModelError, match="llama: " + setting.replace("(", r"\(")):
        family_for(hf).config_from_hf(hf)


def test_llama_reads_transformers4_style_rope_config():
    """Older config.json files keep `rope_theta` at the top and scaling under `rope_scaling`."""
    hf = _config().to_dict()
    hf.pop("rope_parameters")
    hf.update(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = family_for(hf).config_from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.vocab_size == 256 and not cfg.weight_tying
    assert dict(cfg.rope_scaling)["rope_type"] == "llama3"
    assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 8192
