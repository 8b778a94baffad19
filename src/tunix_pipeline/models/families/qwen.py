"""Qwen 2 / 2.5 (`model_type: qwen2`) and Qwen 3 dense (`model_type: qwen3`) on Tunix's models.

Qwen 2 uses Tunix's `Qwen2` as it is (it honours `rope_theta`). Tunix 0.1.7's Qwen 3 attention,
like its Llama, calls `apply_rope` without the config's `rope_theta` (always 1e6), so Qwen 3
uses `RopeAttention`, Tunix's attention with only `apply_rope` replaced (docs/upstream_tunix.md).
Both attend to every position unless given a mask: `compute_logits` and Tunix's trainers and
samplers always pass a causal one. Both cast every weight and activation to their config's `dtype`
(float32 by default): the model is built computing in the run's dtype (`with_compute_dtype`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen2 import params as qwen2_params
from tunix.models.qwen3 import model as qwen3_lib
from tunix.models.qwen3 import params as qwen3_params

from tunix_pipeline import upstream
from tunix_pipeline.models.families.base import Family, require
from tunix_pipeline.models.families.llama import decoder_to_hf, head_dim_of, rope_key, rope_scaling_from_hf, with_rope


def _common(family: str, hf: dict, head_dim: int) -> dict:
    """ModelConfig arguments shared by Qwen 2 and 3, refusing what the Tunix models lack."""
    # rope scaling (e.g. YaRN for long contexts) is not implemented for Qwen here
    theta, _ = rope_scaling_from_hf(family, hf, rope_types=("default",))
    act = hf.get("hidden_act", "silu")
    require(act == "silu", family, "hidden_act", act, "SiLU-gated MLP only")
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)
    ]
    sliding = window is not None and "sliding_attention" in layer_types
    require(not sliding, family, "use_sliding_window", True, "full attention on every layer; Tunix has no sliding window")
    return dict(
        num_layers=layers,
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=head_dim,
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # transformers' default is untied; a wrong flag here drops or leaves out lm_head
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)),
    )


def with_compute_dtype(cfg, dtype: str):
    """`cfg` computing in `dtype`: the weights and activations are cast to it (the weights keep their dtype)."""
    return dataclasses.replace(cfg, dtype=jnp.dtype(dtype))


# ---------------------------------------------------------------------------- Qwen 2


def qwen2_config_from_hf(hf: dict):
    # transformers' Qwen2 always has q/k/v biases and no o bias, as Tunix's Qwen2
    return qwen2_lib.ModelConfig(**_common("qwen2", hf, head_dim_of(hf)))


def qwen2_key_mapping(cfg):
    return upstream.tunix_key_mapping(qwen2_params, cfg)


def qwen2_to_hf_state(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
    state = decoder_to_hf(params, cfg.num_layers, cfg.use_tied_embedding)
    for i in range(cfg.num_layers):
        for n in ("q", "k", "v"):
            state[f"model.layers.{i}.self_attn.{n}_proj.bias"] = np.asarray(params[f"layers.{i}.attn.{n}_bias"])
    return state


QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    model_class=qwen2_lib.Qwen2,
    config_from_hf=qwen2_config_from_hf,
    key_mapping=qwen2_key_mapping,
    preprocess=None,
    to_hf_state=qwen2_to_hf_state,
    with_compute_dtype=with_compute_dtype,
)


# ---------------------------------------------------------------------------- Qwen 3


class Qwen3RopeAttention(qwen3_lib.Attention):
    """Tunix's Qwen 3 attention (q/k norms included) with rope from `config.rope_theta`."""

    def block(self, *args, **kwargs):
        return with_rope(qwen3_lib.Attention.block, rope_key(self.config))(self, *args, **kwargs)


class Qwen3(qwen3_lib.Qwen3):
    """Tunix's Qwen3 whose layers use `Qwen3RopeAttention`."""

    def __init__(self, config, *, rngs):
        super().__init__(config, rngs=rngs)
        for layer in self.layers:
            layer.attn = Qwen3RopeAttention(config, rngs=rngs)


def qwen3_config_from_hf(hf: dict):
    bias = hf.get("attention_bias", False)
    require(not bias, "qwen3", "attention_bias", bias, "Tunix's Qwen3 has no q/k/v/o biases")
    require(not hf.get("num_experts"), "qwen3", "num_experts", hf.get("num_experts"), "dense Qwen 3 only")
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size // heads
    return qwen3_lib.ModelConfig(**_common("qwen3", hf, hf.get("head_dim") or 128))


def qwen3_key_mapping(cfg):
    return upstream.tunix_key_mapping(qwen3_params, cfg)


def qwen3_to_hf_state(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
    state = decoder_to_hf(params, cfg.num_layers, cfg.use_tied_embedding)
    for i in range(cfg.num_layers):
        for n in ("q_norm", "k_norm"):
            state[f"model.layers.{i}.self_attn.{n}.weight"] = np.asarray(params[f"layers.{i}.attn.{n}.w"])
    return state


QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    model_class=Qwen3,
    config_from_hf=qwen3_config_from_hf,
    key_mapping=qwen3_key_mapping,
    preprocess=None,
    to_hf_state=qwen3_to_hf_state,
    with_compute_dtype=with_compute_dtype,
)
