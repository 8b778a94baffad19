"""Llama 2 / 3 / 3.1 / 3.2 (`model_type: llama`, e.g. TinyLlama, meta-llama/Llama-3.2-1B) on
Tunix's `llama3` model, with rotary embeddings computed as the checkpoint says.

Tunix 0.1.7's Llama attention calls `apply_rope` without the config's `rope_theta` (so it
always uses 1e6) and has no `rope_type: llama3` frequency scaling. `RopeAttention` runs
Tunix's own attention code with only its `apply_rope` replaced (docs/upstream_tunix.md).
The rope helpers here are shared with the Qwen 3 family.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax.numpy as jnp
import numpy as np
from tunix.models.llama3 import model as llama_lib
from tunix.models.llama3 import params

from tunix_pipeline import upstream
from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.models.families.base import Family, linear_to_hf, require, rope_settings

# rope types we compute exactly as transformers' `modeling_rope_utils` does
ROPE_TYPES = ("default", "linear", "llama3")


# ---------------------------------------------------------------------------- rope


def rope_scaling_from_hf(family: str, hf: dict, rope_types=ROPE_TYPES) -> tuple[float, tuple]:
    """(rope theta, hashable scaling settings) from config.json, refusing what we cannot compute."""
    rope = rope_settings(hf)
    kind = rope["rope_type"]
    require(kind in rope_types, family, "rope_type", kind, f"supported: {', '.join(rope_types)}")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    require(partial in (None, 1.0), family, "partial_rotary_factor", partial, "rope over the whole head only")
    scaling: tuple = (("rope_type", kind),)
    if kind == "linear":
        scaling += (("factor", float(rope["factor"])),)
    elif kind == "llama3":
        original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            require(rope.get(key) is not None, family, f"rope_parameters.{key}", None, "llama3 rope needs it")
        scaling += (
            ("factor", float(rope["factor"])),
            ("low_freq_factor", float(rope["low_freq_factor"])),
            ("high_freq_factor", float(rope["high_freq_factor"])),
            ("original_max_position_embeddings", int(original)),
        )
    return float(rope["rope_theta"]), scaling


def rope_frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> np.ndarray:
    """Inverse frequencies (head_dim // 2,) float32, as transformers computes them."""
    s = dict(scaling)
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / np.float32(s["factor"])
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ModelError(f"rope_type={kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return inv_freq.astype(np.float32)


def make_apply_rope(inv_freq: tuple[float, ...]):
    """A drop-in for Tunix's `apply_rope(inputs, positions, head_dim, rope_theta)` (split-half
    rotation, as transformers' `rotate_half`) using the given frequencies; `rope_theta` is ignored."""
    def apply_rope(inputs, positions, head_dim=None, rope_theta=None):
        freq = jnp.asarray(np.asarray(inv_freq, np.float32))
        angles = positions[..., None].astype(jnp.float32) * freq  # [B, L, head_dim // 2]
        angles = angles[..., None, :]  # broadcast over heads: [B, L, 1, head_dim // 2]
        sin, cos = jnp.sin(angles), jnp.cos(angles)
        first, second = jnp.split(inputs, 2, axis=-1)
        out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return out.astype(inputs.dtype)

    return apply_rope


@functools.lru_cache(maxsize=None)
def with_rope(method, inv_freq: tuple[float, ...]):
    """Tunix's `method`, unchanged except that the global `apply_rope` it calls is ours."""
    if "apply_rope" not in method.__code__.co_names:
        raise ModelError(f"{method.__qualname__} no longer calls apply_rope: update our rope override")
    scope = dict(method.__globals__, apply_rope=make_apply_rope(inv_freq))
    fn = types.FunctionType(method.__code__, scope, method.__name__, method.__defaults__, method.__closure__)
    fn.__kwdefaults__ = method.__kwdefaults__
    return fn


def rope_key(cfg) -> tuple[float, ...]:
    return tuple(float(x) for x in rope_frequencies(cfg.head_dim, cfg.rope_theta, getattr(cfg, "rope_scaling", ())))


# ---------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class LlamaConfig(llama_lib.ModelConfig):
    """Tunix's Llama config plus the rope scaling Tunix lacks: ((name, value), ...), hashable."""

    rope_scaling: tuple = (("rope_type", "default"),)


class RopeAttention(llama_lib.Attention):
    """Tunix's Llama attention with rope from `config.rope_theta` and `config.rope_scaling`."""

    def block(self, *args, **kwargs):
        return with_rope(llama_lib.Attention.block, rope_key(self.config))(self, *args, **kwargs)


class Llama(llama_lib.Llama3):
    """Tunix's Llama3 whose layers use `RopeAttention`."""

    def __init__(self, config, *, rngs):
        super().__init__(config, rngs=rngs)
        for layer in self.layers:
            layer.attn = RopeAttention(config, rngs=rngs)


def head_dim_of(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def config_from_hf(hf: dict) -> LlamaConfig:
    theta, scaling = rope_scaling_from_hf("llama", hf)
    act = hf.get("hidden_act", "silu")
    require(act == "silu", "llama", "hidden_act", act, "SiLU-gated MLP only")
    require(not hf.get("attention_bias", False), "llama", "attention_bias", True, "no q/k/v/o biases")
    require(not hf.get("mlp_bias", False), "llama", "mlp_bias", True, "no MLP biases")
    return LlamaConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=head_dim_of(hf),
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # transformers' LlamaConfig default is untied; a wrong flag here drops or leaves out lm_head
        weight_tying=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
    )


def key_mapping(cfg):
    return upstream.tunix_key_mapping(params, cfg)


# ---------------------------------------------------------------------------- export


def decoder_to_hf(params: dict, num_layers: int, tied: bool) -> dict[str, np.ndarray]:
    """HF tensors of the Llama-shaped decoder shared by Tunix's llama3, qwen2 and qwen3 models."""
    p = {k: np.asarray(v) for k, v in params.items()}
    state = {
        "model.embed_tokens.weight": p["embedder.input_embedding"],
        "model.norm.weight": p["final_norm.w"],
    }
    if not tied:
        state["lm_head.weight"] = linear_to_hf(p["lm_head.w"])  # (embed, vocab) -> (vocab, embed)
    for i in range(num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj"):  # (embed, heads, head_dim) -> (heads * head_dim, embed)
            w = p[t + f"attn.{n}.w"]
            state[h + f"self_attn.{n}.weight"] = linear_to_hf(w.reshape(w.shape[0], -1))
        o = p[t + "attn.o_proj.w"]  # (heads, head_dim, embed) -> (embed, heads * head_dim)
        state[h + "self_attn.o_proj.weight"] = linear_to_hf(o.reshape(-1, o.shape[-1]))
        for n in ("gate_proj", "up_proj", "down_proj"):
            state[h + f"mlp.{n}.weight"] = linear_to_hf(p[t + f"mlp.{n}.kernel"])
        state[h + "input_layernorm.weight"] = p[t + "input_layernorm.w"]
        state[h + "post_attention_layernorm.weight"] = p[t + "post_attention_layernorm.w"]
    return state


def to_hf_state(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
    return decoder_to_hf(params, cfg.num_layers, cfg.weight_tying)


LLAMA = Family(
    name="llama",
    model_types=("llama",),
    model_class=Llama,
    config_from_hf=config_from_hf,
    key_mapping=key_mapping,
    preprocess=None,
    to_hf_state=to_hf_state,
)
