"""Gemma 2, e.g. google/gemma-2-2b: Tunix's `gemma` model (Gemma 1 and 2 share it), built with the
checkpoint's own layer pattern, sliding window, softcaps and query scaling."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from tunix.models.gemma import model as gemma_lib
from tunix.models.gemma import params_safetensors

from tunix_pipeline import upstream
from tunix_pipeline.models.families.base import Family, require, rope_settings
from tunix_pipeline.models.families.gemma import decoder_to_hf

NAME = "gemma2"
LAYER_TYPES = {"sliding_attention": gemma_lib.AttentionType.LOCAL_SLIDING, "full_attention": gemma_lib.AttentionType.GLOBAL}


def setting(hf: dict, key: str, default):
    """A config.json value, or transformers' default when the key is absent (an explicit null stays None)."""
    return hf[key] if key in hf else default


@dataclasses.dataclass(slots=True)
class Gemma2Config(gemma_lib.ModelConfig):
    """Tunix's Gemma config plus HF's `query_pre_attn_scalar` (queries scaled by its ** -0.5; None: head_dim)."""

    query_pre_attn_scalar: float | None = None


class QueryScaledEinsum(gemma_lib.Einsum):
    """Tunix's q (or fused qkv) projection with the queries multiplied by `query_factor`.

    Tunix scales queries by head_dim ** -0.5; rope is linear, so scaling the projected queries by
    (query_pre_attn_scalar / head_dim) ** -0.5 gives the checkpoint's scaling. The weight is unchanged.
    """

    def __init__(self, einsum_str, shape, *, rngs, sharding, query_factor: float):
        super().__init__(einsum_str, shape, rngs=rngs, sharding=sharding)
        self.query_factor = query_factor

    def __call__(self, x):
        out = super().__call__(x)
        if self.einsum_str.endswith("->SBTNH"):  # fused: (q, k, v) stacked first
            return out.at[0].multiply(jnp.asarray(self.query_factor, out.dtype))
        return out * jnp.asarray(self.query_factor, out.dtype)


def query_factor(config) -> float:
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar is None or float(scalar) == float(config.head_dim):
        return 1.0
    return float((float(scalar) / config.head_dim) ** -0.5)


def sliding_window_mask(attention_mask, window: int):
    """`attention_mask` (B, T, S) limited to the last `window` cache slots up to each query's own slot.

    The window counts cache slots, as transformers' and Tunix's Gemma 3 do; a query's slot is the
    last one it may attend to (causal masks include the query itself), with or without a KV cache.
    """
    slots = jnp.arange(attention_mask.shape[-1])
    own = jnp.max(jnp.where(attention_mask, slots, -1), axis=-1, keepdims=True)
    return jnp.logical_and(attention_mask, slots > own - window)


class Gemma2(gemma_lib.Gemma):
    """Tunix's Gemma with two fixes for Gemma 2 checkpoints.

    - Query scaling: the q projections are replaced where `query_pre_attn_scalar` is not head_dim.
    - Sliding windows: Tunix's local layers compare token positions (padding excluded) with cache
      slots (padding included), which shifts the window by the left padding of a sampler's prompt;
      ours are built as global layers and get the windowed mask from `__call__`.
    """

    def __init__(self, config, *, rngs):
        tunix_types = (gemma_lib.AttentionType.GLOBAL,) * config.num_layers
        super().__init__(dataclasses.replace(config, attention_types=tunix_types), rngs=rngs)
        self.config = config
        self.sliding = tuple(t == gemma_lib.AttentionType.LOCAL_SLIDING for t in config.attention_types)
        factor = query_factor(config)
        if factor == 1.0:
            return
        shd = config.shd_config
        for layer in self.layers:
            attn = layer.attn
            name, sharding = ("qkv_einsum", shd.qkv_weight_cndh) if attn.use_qkv_einsum else ("q_einsum", shd.q_weight_ndh)
            old = getattr(attn, name)
            setattr(attn, name, QueryScaledEinsum(old.einsum_str, old.shape, rngs=rngs, sharding=sharding, query_factor=factor))

    def __call__(self, last_tokens, positions, cache, attention_mask, output_hidden_states: bool = False):
        """Tunix's `Gemma.__call__`, with each local layer's mask windowed."""
        local_mask = (
            sliding_window_mask(attention_mask, self.config.sliding_window_size) if any(self.sliding) else None
        )
        new_cache = None if cache is None else {}
        x = self.embedder.encode(last_tokens)
        for i, layer in enumerate(self.layers):
            name = f"layer_{i}"
            mask = local_mask if self.sliding[i] else attention_mask
            layer_cache, x = layer(x, positions, cache[name] if cache else None, mask)
            if cache is not None:
                new_cache[name] = layer_cache
        x = self.final_norm(x)
        if output_hidden_states:
            self.sow(nnx.Intermediate, "all_hidden_states", x)
        logits = self.embedder.decode(x)
        if self.final_logits_softcap is not None:
            logits = jnp.tanh(logits / self.final_logits_softcap) * self.final_logits_softcap
        return logits, new_cache


def layer_types(hf: dict, family: str, default: list[str]) -> list[str]:
    types = list(hf.get("layer_types") or default)
    require(len(types) == hf["num_hidden_layers"], family, "layer_types", types, f"one per layer ({hf['num_hidden_layers']})")
    for t in types:
        require(t in LAYER_TYPES, family, "layer_types", t, "sliding_attention or full_attention")
    if "sliding_attention" in types:
        window = setting(hf, "sliding_window", 4096)
        require(isinstance(window, int) and window > 0, family, "sliding_window", window, "a positive window for the sliding layers")
    return types


def check_common(hf: dict, family: str) -> None:
    """Settings the Tunix Gemma models (2 and 3) cannot honour."""
    eps = setting(hf, "rms_norm_eps", 1e-6)
    require(abs(float(eps) - 1e-6) < 1e-12, family, "rms_norm_eps", eps, "Tunix fixes it at 1e-6")
    require(setting(hf, "tie_word_embeddings", True), family, "tie_word_embeddings", False, "Gemma ties the output head")
    act = setting(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
    require(act == "gelu_pytorch_tanh", family, "hidden_activation", act, "gelu_pytorch_tanh (GELU, tanh approximation)")
    require(not hf.get("attention_bias"), family, "attention_bias", hf.get("attention_bias"), "no attention biases")
    bidirectional = hf.get("use_bidirectional_attention")
    require(not bidirectional, family, "use_bidirectional_attention", bidirectional, "causal attention only")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    require(head_dim % 2 == 0, family, "head_dim", head_dim, "an even head_dim for rope")


def config_from_hf(hf: dict) -> Gemma2Config:
    """Tunix's Gemma hard-codes rope theta 10000 (no scaling) and RMSNorm eps 1e-6: refuse other values."""
    check_common(hf, NAME)
    rope = rope_settings(hf)
    require(float(rope["rope_theta"]) == 10000.0, NAME, "rope_theta", rope["rope_theta"], "Tunix's Gemma fixes it at 10000")
    require(rope["rope_type"] == "default", NAME, "rope_scaling", rope["rope_type"], "no rope scaling")
    layers = hf["num_hidden_layers"]
    types = layer_types(hf, NAME, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    return Gemma2Config(
        num_layers=layers,
        num_embed=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        final_logit_softcap=setting(hf, "final_logit_softcapping", 30.0),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=tuple(LAYER_TYPES[t] for t in types),
        attn_logits_soft_cap=setting(hf, "attn_logit_softcapping", 50.0),
        sliding_window_size=setting(hf, "sliding_window", 4096) if "sliding_attention" in types else None,
        query_pre_attn_scalar=float(setting(hf, "query_pre_attn_scalar", 256)),
    )


def key_mapping(cfg):
    """Tunix's Gemma 2 safetensors mapping, as is (its norms are right for Gemma 2)."""
    return upstream.tunix_key_mapping(params_safetensors, cfg)


def preprocess(cfg):
    return upstream.tunix_preprocess(params_safetensors, cfg)


NORMS = {  # HF name -> Tunix name
    "input_layernorm": "pre_attention_norm",
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "pre_ffw_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


to_hf_state = decoder_to_hf(NORMS)


GEMMA2 = Family(
    name=NAME,
    model_types=("gemma2",),
    model_class=Gemma2,
    config_from_hf=config_from_hf,
    key_mapping=key_mapping,
    preprocess=preprocess,
    to_hf_state=to_hf_state,
)
