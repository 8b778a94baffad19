"""Gemma 2 checkpoints: logits and greedy tokens equal to transformers', and exported back unchanged."""

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from tunix_pipeline.models import ModelError, compute_logits, load_model
from tunix_pipeline.models.families import family_for
from tunix_pipeline.models.families.gemma2 import query_factor

from .parity import assert_greedy_match, assert_logits_match, logits_atol, sample_batch, save_hf_model


def _config(**overrides):
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, pad_token_id=0,
        # a window shorter than the 12-token batch, so that the sliding layers differ from global ones
        sliding_window=4, query_pre_attn_scalar=16,  # = head_dim, as in gemma-2-2b
        # weights large enough for sharp attention and logits, and a final softcap small enough to bite;
        # no attention softcap: transformers' default (sdpa) attention ignores it, see the eager test below
        final_logit_softcapping=3.0, attn_logit_softcapping=None, initializer_range=0.2,
    )
    return transformers.Gemma2Config(**{**base, **overrides})


CASES = {
    "mqa": {},
    "gqa-query-scalar-pattern": {
        "num_key_value_heads": 2,
        # queries scaled by (hidden_size // heads) ** -0.5 = 18 ** -0.5, not head_dim ** -0.5 = 16 ** -0.5:
        # the 144 vs 128 of gemma-2-27b
        "hidden_size": 72,
        "query_pre_attn_scalar": 18,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
    "mha-query-scalar": {"num_key_value_heads": 4, "query_pre_attn_scalar": 8, "final_logit_softcapping": None},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_gemma2_logits_match_transformers(tmp_path, overrides):
    folder = save_hf_model(_config(**overrides), tmp_path / "gemma2")
    tokens, mask = sample_batch(256)
    assert_logits_match(folder, tokens, mask)


def test_gemma2_left_padded_batch_matches_transformers(tmp_path):
    """Left padding, as Tunix's sampler pads prompts: sliding windows count cache slots, as in transformers."""
    folder = save_hf_model(_config(num_key_value_heads=2), tmp_path / "gemma2")
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


def test_gemma2_greedy_generation_matches_transformers(tmp_path):
    folder = save_hf_model(_config(num_hidden_layers=2), tmp_path / "gemma2")
    assert_greedy_match(folder, sample_batch(256)[0][0, :5])


def test_gemma2_attention_softcap_matches_transformers_eager_attention(tmp_path):
    """transformers 5 runs Gemma 2 with sdpa by default, which drops `attn_logit_softcapping`;
    its eager attention applies it, as Gemma 2 was trained (and as Tunix does)."""
    folder = save_hf_model(_config(attn_logit_softcapping=2.0, num_key_value_heads=2), tmp_path / "gemma2")
    tokens, mask = sample_batch(256)
    model, _ = load_model(folder, None)
    ours = compute_logits(model, tokens, mask)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = reference.eval()(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
    real = mask.astype(bool)
    theirs = theirs.logits.float().numpy()[real]
    np.testing.assert_allclose(ours[real], theirs, atol=logits_atol(folder, theirs), rtol=0)


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_gemma2_exports_the_checkpoint_tensors(tmp_path, overrides):
    folder = save_hf_model(_config(**overrides), tmp_path / "gemma2")
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


def test_gemma2_reads_the_gemma_2_27b_config():
    """google/gemma-2-27b's config: queries scaled by 144 ** -0.5 with head_dim 128."""
    hf = dict(
        model_type="gemma2", vocab_size=256000, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=144, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    cfg = family_for(hf).config_from_hf(hf)
    assert query_factor(cfg) == pytest.approx((144 / 128) ** -0.5)  # on top of Tunix's 128 ** -0.5


@pytest.mark.parametrize(
    "overrides, setting",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}, "rope_theta"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_gemma2_refuses_settings_tunix_cannot_honour(overrides, setting):
    hf = _config(**overrides).to_dict()
    with pytest.raises(ModelError, match=f"gemma2: {setting}="):
        family_for(hf).config_from_hf(hf)
