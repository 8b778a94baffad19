"""Qwen 2 / 2.5 and Qwen 3 checkpoints: logits and greedy tokens equal to transformers', and export."""

import json
from pathlib import Path

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from tunix_pipeline.models import ModelError
from tunix_pipeline.models.families import family_for

from .parity import assert_greedy_match, assert_logits_match, sample_batch, save_hf_model
from .test_family_llama import assert_round_trip

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    # weights large enough that attention is not near-uniform: a wrong rope shows in the logits
    initializer_range=0.2,
)


def _qwen2(**overrides):
    return transformers.Qwen2Config(**{**BASE, **overrides})


def _qwen3(**overrides):
    return transformers.Qwen3Config(**{**BASE, "head_dim": 16, **overrides})


def save_qwen(config, folder: Path) -> Path:
    """`save_hf_model`, then random q/k/v biases (transformers initialises them to zero)."""
    folder = save_hf_model(config, folder)
    rng = np.random.default_rng(1)
    for f in folder.glob("*.safetensors"):
        tensors = load_file(f)
        for key in [k for k in tensors if k.endswith("_proj.bias")]:
            tensors[key] = rng.normal(0.0, 0.5, tensors[key].shape).astype(tensors[key].dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return folder


CASES = {
    "qwen2_gqa": _qwen2(),
    "qwen2_mha_tied_theta1m": _qwen2(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=1_000_000.0),
    # Tunix's Qwen 3 would use rope theta 1e6 here
    "qwen3_gqa_theta10k": _qwen3(),
    # head_dim not hidden_size // heads, as in Qwen 3 checkpoints
    "qwen3_mqa_tied_headdim32_theta5m": _qwen3(num_key_value_heads=1, tie_word_embeddings=True, head_dim=32, rope_theta=5_000_000.0),
}


@pytest.mark.parametrize("config", list(CASES.values()), ids=list(CASES))
def test_qwen_logits_match_transformers(tmp_path, config):
    folder = save_qwen(config, tmp_path / "qwen")
    tokens, mask = sample_batch(256)
    assert_logits_match(folder, tokens, mask)


@pytest.mark.parametrize("config", [_qwen2(), _qwen3()], ids=["qwen2", "qwen3"])
def test_qwen_greedy_generation_matches_transformers(tmp_path, config):
    folder = save_qwen(config, tmp_path / "qwen")
    assert_greedy_match(folder, sample_batch(256)[0][0, :5])


@pytest.mark.parametrize(
    "config",
    [_qwen2(), _qwen2(tie_word_embeddings=True), _qwen3(), _qwen3(tie_word_embeddings=True)],
    ids=["qwen2_untied", "qwen2_tied", "qwen3_untied", "qwen3_tied"],
)
def test_qwen_export_round_trips_the_checkpoint(tmp_path, config):
    assert_round_trip(save_qwen(config, tmp_path / "qwen"))


@pytest.mark.parametrize(
    "config, message",
    [
        (_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0), "qwen2: use_sliding_window=True"),
        (_qwen2(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}), "qwen2: rope_type='yarn'"),
        (_qwen3(attention_bias=True), "qwen3: attention_bias=True"),
        (_qwen3(rope_scaling={"rope_type": "linear", "factor": 2.0}), "qwen3: rope_type='linear'"),
        (_qwen3(hidden_act="gelu"), "qwen3: hidden_act='gelu'"),
    ],
    ids=["qwen2_sliding_window", "qwen2_yarn", "qwen3_attention_bias", "qwen3_linear_rope", "qwen3_gelu"],
)
def test_qwen_refuses_unsupported_settings(config, message):
    hf = json.loads(config.to_json_string())
    with pytest.raises(ModelError, match=message):
        family_for(hf).config_from_hf(hf)


def test_qwen_configs_come_from_the_checkpoint():
    """Sizes and flags from config.json (not Tunix presets); transformers' defaults where it is silent."""
    hf = json.loads(_qwen3(vocab_size=512, rms_norm_eps=1e-5).to_json_string())
    del hf["head_dim"], hf["tie_word_embeddings"]
    cfg = family_for(hf).config_from_hf(hf)
    assert (cfg.vocab_size, cfg.head_dim, cfg.norm_eps, cfg.use_tied_embedding) == (512, 128, 1e-5, False)
    hf = json.loads(_qwen2(tie_word_embeddings=True).to_json_string())
    hf.pop("rope_parameters")
    hf["rope_theta"] = 1_000_000.0  # transformers 4 style
    cfg = family_for(hf).config_from_hf(hf)
    assert (cfg.head_dim, cfg.rope_theta, cfg.use_tied_embedding) == (16, 1_000_000.0, True)


def _matmul_dtypes(fn, *args) -> set:
    """The operand dtypes of every matmul over activations (batch x length x ...) in `fn`'s program, nested
    jaxprs included: the projections, attention and head; not RoPE's float32 positions x frequencies."""
    import jax

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                if max(len(v.aval.shape) for v in eqn.invars) >= 3:
                    yield from (str(v.aval.dtype) for v in eqn.invars if "int" not in str(v.aval.dtype))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return set(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_qwen_computes_in_the_runs_compute_dtype(tmp_path):
    """Tunix's Qwen casts weights and activations to its config's dtype (float32 unless set): with
    `sft.compute_dtype: bfloat16` over float32 weights, every matmul (projections, attention, the head)
    is bf16; without, float32, as the parity tests above check against transformers."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import utils as sft_utils

    from tunix_pipeline.models.loading import load_model

    folder = save_qwen(_qwen2(), tmp_path / "qwen")
    tokens, mask = (jnp.asarray(x) for x in sample_batch(256))
    positions = sft_utils.build_positions_from_mask(mask.astype(bool))
    attention = sft_utils.make_causal_attn_mask(mask.astype(bool))
    for compute, expected in ((None, "float32"), ("bfloat16", "bfloat16")):
        model, cfg = load_model(folder, None, "float32", compute_dtype=compute)
        graph, state = nnx.split(model)
        assert {str(x.dtype) for x in jax.tree.leaves(state)} == {"float32"}  # the weights keep their dtype

        def forward(state):
            return nnx.merge(graph, state)(tokens, positions, None, attention)[0]

        assert _matmul_dtypes(forward, state) == {expected}, compute
        assert str(forward(state).dtype) == "float32"  # Tunix's Qwen returns its logits upcast, either way
