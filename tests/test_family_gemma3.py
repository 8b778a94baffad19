"""Gemma 3 text checkpoints: logits and greedy tokens equal to transformers', and exported back unchanged."""

import json

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from tunix_pipeline.models import ModelError, compute_logits, load_model
from tunix_pipeline.models.families import family_for

from .parity import assert_greedy_match, assert_logits_match, logits_atol, sample_batch, save_hf_model

PATTERN = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]  # not Tunix's 5:1


def _config(**overrides):
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, pad_token_id=0,
        # a window shorter than the 12-token batch, so that the local layers differ from global ones
        sliding_window=4, layer_types=PATTERN, query_pre_attn_scalar=16,  # = head_dim, as in gemma-3-1b
        # local and global rope bases both away from their defaults, and linear scaling on the global layers
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
        },
        initializer_range=0.2,  # sharp attention and logits
    )
    return transformers.Gemma3TextConfig(**{**base, **overrides})


CASES = {
    "mqa": {},
    "gqa-final-softcap": {"num_key_value_heads": 2, "final_logit_softcapping": 3.0},
    # queries scaled by (hidden_size // heads) ** -0.5 = 21 ** -0.5, not head_dim ** -0.5 = 16 ** -0.5:
    # the 168 vs 128 of gemma-3-27b
    "mha-query-scalar": {"num_key_value_heads": 4, "hidden_size": 84, "query_pre_attn_scalar": 21},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_gemma3_logits_match_transformers(tmp_path, overrides):
    folder = save_hf_model(_config(**overrides), tmp_path / "gemma3")
    tokens, mask = sample_batch(256)
    assert_logits_match(folder, tokens, mask)


def test_gemma3_reads_transformers4_configs(tmp_path):
    """Hub configs written by transformers 4: rope_theta, rope_local_base_freq, rope_scaling (global layers
    only) and sliding_window_pattern instead of layer_types; transformers 5 reads them the same way."""
    folder = save_hf_model(_config(num_hidden_layers=3, layer_types=None), tmp_path / "gemma3")
    path = folder / "config.json"
    hf = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        hf.pop(key, None)
    hf.update(rope_theta=5000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf["sliding_window_pattern"] = 2
    path.write_text(json.dumps(hf))
    cfg = family_for(hf).config_from_hf(hf)
    assert [t.name for t in cfg.attention_types] == ["LOCAL_SLIDING", "GLOBAL", "LOCAL_SLIDING"]
    assert (cfg.local_base_frequency, cfg.global_base_frequency, cfg.global_scale_factor) == (100.0, 5000.0, 2.0)
    tokens, mask = sample_batch(256)
    assert_logits_match(folder, tokens, mask)


def test_gemma3_left_padded_batch_matches_transformers(tmp_path):
    """Left padding, as Tunix's sampler pads prompts: sliding windows count cache slots, as in transformers."""
    folder = save_hf_model(_config(num_key_value_heads=2), tmp_path / "gemma3")
    tokens, mask = sample_batch(256)
    tokens[1], mask[1] = np.roll(tokens[1], 5), np.roll(mask[1], 5)  # 5 pads, then 7 tokens
    model, _ = load_model(folder, None)
    ours = compute_logits(model, tokens, mask)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0)),
        ).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=logits_atol(folder, theirs[real]), rtol=0)


@pytest.mark.slow
def test_gemma3_greedy_generation_matches_transformers(tmp_path):
    folder = save_hf_model(_config(num_hidden_layers=2, layer_types=PATTERN[:2]), tmp_path / "gemma3")
    assert_greedy_match(folder, sample_batch(256)[0][0, :5])


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_gemma3_exports_the_checkpoint_tensors(tmp_path, overrides):
    folder = save_hf_model(_config(**overrides), tmp_path / "gemma3")
    model, cfg = load_model(folder, None)
    params = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    hf = _config(**overrides).to_dict()
    exported = family_for(hf).to_hf_state(params, cfg, hf)
    saved = load_file(folder / "model.safetensors")
    saved.pop("lm_head.weight", None)  # tied to the embeddings
    assert sorted(exported) == sorted(saved)
    for key, value in saved.items():  # loading and exporting only copy and transpose: bitwise
        assert exported[key].shape == value.shape, key
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_gemma3_reads_the_layer_pattern_and_rope_of_the_checkpoint():
    hf = _config().to_dict()
    cfg = family_for(hf).config_from_hf(hf)
    assert [t.name for t in cfg.attention_types] == ["LOCAL_SLIDING", "GLOBAL", "LOCAL_SLIDING", "LOCAL_SLIDING"]
    assert (cfg.local_base_frequency, cfg.global_base_frequency) == (100.0, 5000.0)
    assert (cfg.local_scale_factor, cfg.global_scale_factor) == (1.0, 4.0)
    assert cfg.sliding_window_size == 4


def test_gemma3_reads_the_gemma_3_27b_config():
    """google/gemma-3-27b-it's text config (transformers 4 keys): queries scaled by 168 ** -0.5 with head_dim 128."""
    hf = dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
        sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6,
    )
    cfg = family_for(hf).config_from_hf(hf)
    assert cfg.query_pre_attn_norm.name == "BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS"  # (5376 // 32) ** -0.5
    assert (cfg.head_dim, cfg.global_scale_factor, cfg.local_scale_factor) == (128, 8.0, 1.0)


@pytest.mark.parametrize(
    "overrides, setting",
    [
        ({"query_pre_attn_scalar": 10}, "query_pre_attn_scalar"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        (
            {"rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
            }},
            r"rope_parameters\[full_attention\].rope_type",
        ),
    ],
)
def test_gemma3_refuses_settings_tunix_cannot_honour(overrides, setting):
    hf = _config(**overrides).to_dict()
    with pytest.raises(ModelError, match=f"gemma3_text: {setting}="):
        family_for(hf).config_from_hf(hf)


def test_gemma3_serves_tunix_rl_log_probs(tmp_path):
    """Tunix's GRPO scores completions with `compute_per_token_logps`, which passes `segment_ids` to any model
    whose __call__ takes **kwargs: ours takes Tunix's own arguments, and the log-probs are those of our logits."""
    import jax
    from tunix.rl import common

    model, _ = load_model(save_hf_model(_config(), tmp_path / "gemma3"), None)
    tokens, _ = sample_batch(256)
    tokens = tokens[:1]
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(graphdef, state, tokens[:, :6], tokens[:, 6:], pad_id=0, eos_id=1)
    logits = compute_logits(model, tokens, np.ones_like(tokens))
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits[0, 5:11])), tokens[0, 6:, None], axis=1)[:, 0]
    # the same fp32 forward pass compiled twice: a log-prob is a logit less a logsumexp, each off by rounding
    atol = 2 * logits_atol(tmp_path / "gemma3", logits)
    np.testing.assert_allclose(np.asarray(logps[0]), expected, atol=atol, rtol=0)
