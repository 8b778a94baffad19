"""Gemma 3 text, e.g. google/gemma-3-1b-it: Tunix's `gemma3` model, built with the checkpoint's
per-layer local/global pattern (Tunix cycles a fixed 5:1 pattern) and rope bases and scaling."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.gemma3 import params_safetensors
from tunix.utils import compat

from tunix_pipeline import upstream
from tunix_pipeline.models.families.base import Family, require
from tunix_pipeline.models.families.gemma import decoder_to_hf
from tunix_pipeline.models.families.gemma2 import check_common, layer_types, setting

NAME = "gemma3_text"
LAYER_TYPES = {
    "sliding_attention": gemma3_lib.AttentionType.LOCAL_SLIDING,
    "full_attention": gemma3_lib.AttentionType.GLOBAL,
}
QueryNorm = gemma3_lib.QueryPreAttentionNormalisation


@dataclasses.dataclass(slots=True, kw_only=True)
class Gemma3TextConfig(gemma3_lib.ModelConfig):
    """Tunix's Gemma 3 config plus the per-layer attention types and the final logit softcap."""

    attention_types: tuple = ()  # empty: Tunix's 5 local : 1 global pattern
    final_logit_softcap: float | None = None


class Gemma3Text(gemma3_lib.Gemma3):
    """Tunix's Gemma 3 with layers of `config.attention_types` and an optional final logit softcap."""

    def __init__(self, config, *, rngs):
        # Tunix builds everything but the layers; ours follow the checkpoint's pattern
        super().__init__(dataclasses.replace(config, num_layers=0), rngs=rngs)
        self.config = config
        types = tuple(config.attention_types) or tuple(
            itertools.islice(itertools.cycle(gemma3_lib.GEMMA3_ATTENTION_PATTERN), config.num_layers)
        )
        if len(types) != config.num_layers:
            raise ValueError(f"{len(types)} attention types for {config.num_layers} layers")
        self.layers = compat.ModuleList(
            [gemma3_lib.DecoderLayer(config=config, attn_type=t, rngs=rngs) for t in types]
        )

    # Tunix's own signature, not **kwargs: Tunix's RL code passes `segment_ids` to any model taking **kwargs
    def __call__(self, last_tokens, positions=None, cache=None, attention_mask=None, output_hidden_states=False, *, images=None):
        logits, cache = super().__call__(last_tokens, positions, cache, attention_mask, output_hidden_states, images=images)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits, cache


def rope_per_layer_type(hf: dict) -> dict[str, dict]:
    """{"full_attention": {...}, "sliding_attention": {...}} rope settings, from transformers 5's
    per-type `rope_parameters` or transformers 4's `rope_theta`/`rope_local_base_freq`/`rope_scaling`
    (the scaling there applies to the global layers only)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    for rope in (full, local):
        rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return {"full_attention": full, "sliding_attention": local}


def rope_scale(rope: dict, layer_type: str) -> float:
    """Tunix's rope divides positions by a factor: transformers' "linear" rope."""
    kind = rope["rope_type"]
    require(kind in ("default", "linear"), NAME, f"rope_parameters[{layer_type}].rope_type", kind, "default or linear")
    factor = float(rope.get("factor", 1.0)) if kind == "linear" else 1.0
    require(factor >= 1.0, NAME, f"rope_parameters[{layer_type}].factor", factor, "a factor >= 1")
    return factor


def query_norm(hf: dict, head_dim: int) -> QueryNorm:
    """Tunix scales queries by head_dim ** -0.5 or (hidden_size // heads) ** -0.5; transformers by
    query_pre_attn_scalar ** -0.5 (q/k are RMS-normed first, so no other scale can be folded in)."""
    scalar = float(setting(hf, "query_pre_attn_scalar", 256))
    per_head = hf["hidden_size"] // hf["num_attention_heads"]
    supported = f"head_dim ({head_dim}) or hidden_size // num_attention_heads ({per_head})"
    require(scalar in (float(head_dim), float(per_head)), NAME, "query_pre_attn_scalar", scalar, supported)
    if scalar == float(head_dim):
        return QueryNorm.BY_ONE_OVER_SQRT_HEAD_DIM
    return QueryNorm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS


def config_from_hf(hf: dict) -> Gemma3TextConfig:
    """Tunix's Gemma 3 hard-codes RMSNorm eps 1e-6 and has no attention logit softcap: refuse other values."""
    check_common(hf, NAME)
    softcap = setting(hf, "attn_logit_softcapping", None)
    require(softcap is None, NAME, "attn_logit_softcapping", softcap, "none: Tunix's Gemma 3 has no attention softcap")
    layers = hf["num_hidden_layers"]
    pattern = int(setting(hf, "sliding_window_pattern", None) or hf.get("_sliding_window_pattern") or 6)
    types = layer_types(hf, NAME, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)])
    rope = rope_per_layer_type(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return Gemma3TextConfig(
        num_layers=layers,
        num_embed=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=head_dim,
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        sliding_window_size=setting(hf, "sliding_window", 4096) if "sliding_attention" in types else None,
        local_base_frequency=float(rope["sliding_attention"]["rope_theta"]),
        global_base_frequency=float(rope["full_attention"]["rope_theta"]),
        local_scale_factor=rope_scale(rope["sliding_attention"], "sliding_attention"),
        global_scale_factor=rope_scale(rope["full_attention"], "full_attention"),
        query_pre_attn_norm=query_norm(hf, head_dim),
        attention_types=tuple(LAYER_TYPES[t] for t in types),
        final_logit_softcap=setting(hf, "final_logit_softcapping", None),
    )


def key_mapping(cfg):
    """Tunix's Gemma 3 safetensors mapping, as is."""
    return upstream.tunix_key_mapping(params_safetensors, cfg)


def preprocess(cfg):
    return upstream.tunix_preprocess(params_safetensors, cfg)


NORMS = {  # HF name -> Tunix name
    "input_layernorm": "pre_attention_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "pre_ffw_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn._query_norm",
    "self_attn.k_norm": "attn._key_norm",
}


to_hf_state = decoder_to_hf(NORMS)


GEMMA3 = Family(
    name=NAME,
    model_types=("gemma3_text",),
    model_class=Gemma3Text,
    config_from_hf=config_from_hf,
    key_mapping=key_mapping,
    preprocess=preprocess,
    to_hf_state=to_hf_state,
)
