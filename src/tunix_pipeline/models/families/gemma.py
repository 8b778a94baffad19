"""Gemma (1), e.g. google/gemma-2b: Tunix's `gemma` model with Gemma 1's norms mapped right."""

from __future__ import annotations

import numpy as np
from tunix.models.gemma import model as gemma_lib
from tunix.models.gemma import params_safetensors

from tunix_pipeline import upstream
from tunix_pipeline.models.families.base import Family, linear_to_hf, require, rope_settings


def config_from_hf(hf: dict):
    """Tunix's Gemma hard-codes rope theta 10000, RMSNorm eps 1e-6, query scaling head_dim**-0.5,
    tied embeddings and GELU (tanh): refuse checkpoints that differ (docs/upstream_tunix.md)."""
    rope = rope_settings(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    supported = "Tunix's Gemma 1 fixes it"
    require(float(rope["rope_theta"]) == 10000.0, "gemma", "rope_theta", rope["rope_theta"], supported + " at 10000")
    require(rope["rope_type"] == "default", "gemma", "rope_scaling", rope["rope_type"], "no rope scaling")
    require(abs(float(hf.get("rms_norm_eps", 1e-6)) - 1e-6) < 1e-12, "gemma", "rms_norm_eps", hf.get("rms_norm_eps"), supported + " at 1e-6")
    require(hf.get("tie_word_embeddings", True), "gemma", "tie_word_embeddings", False, "Gemma ties the output head")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    require(act in ("gelu_pytorch_tanh", "gelu"), "gemma", "hidden_activation", act, "GELU (tanh approximation)")
    layers = hf["num_hidden_layers"]
    return gemma_lib.ModelConfig(
        num_layers=layers,
        num_embed=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=head_dim,
        num_kv_heads=hf["num_key_value_heads"],
        final_logit_softcap=None,
        use_post_attn_norm=False,
        use_post_ffw_norm=False,
        attention_types=(gemma_lib.AttentionType.GLOBAL,) * layers,
    )


def key_mapping(cfg):
    """Tunix's Gemma mapping, except that Gemma 1's `post_attention_layernorm` is the pre-MLP norm."""
    mapping = upstream.tunix_key_mapping(params_safetensors, cfg)
    mapping[r"model\.layers\.([0-9]+)\.post_attention_layernorm\.weight"] = (r"layers.\1.pre_ffw_norm.scale", None)
    return mapping


def preprocess(cfg):
    return upstream.tunix_preprocess(params_safetensors, cfg)


def attention_to_hf(params: dict, i: int, cfg) -> dict[str, np.ndarray]:
    """q/k/v/o projections of layer i, from Tunix's einsum weights (shared by the Gemma families)."""
    p = f"layers.{i}.attn."
    if p + "qkv_einsum.w" in params:  # multi-head: q, k, v stacked
        q, k, v = params[p + "qkv_einsum.w"]
    else:
        q = params[p + "q_einsum.w"]
        k, v = params[p + "kv_einsum.w"]

    def proj(w):  # (heads, embed, head_dim) -> (heads * head_dim, embed)
        return np.ascontiguousarray(w.transpose(0, 2, 1).reshape(-1, w.shape[1]))

    o = params[p + "attn_vec_einsum.w"]  # (heads, head_dim, embed)
    h = f"model.layers.{i}.self_attn."
    return {
        h + "q_proj.weight": proj(q),
        h + "k_proj.weight": proj(k),
        h + "v_proj.weight": proj(v),
        h + "o_proj.weight": np.ascontiguousarray(o.reshape(-1, o.shape[-1]).T),
    }


def mlp_to_hf(params: dict, i: int) -> dict[str, np.ndarray]:
    p, h = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    return {h + f"{n}.weight": linear_to_hf(params[p + f"{n}.kernel"]) for n in ("gate_proj", "up_proj", "down_proj")}


def decoder_to_hf(norms: dict[str, str]):
    """`to_hf_state` for a Gemma family whose layer norms are named `norms` (HF name -> Tunix name)."""
    def to_hf_state(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
        state = {
            "model.embed_tokens.weight": params["embedder.input_embedding"],
            "model.norm.weight": params["final_norm.scale"],
        }
        for i in range(cfg.num_layers):
            state.update(attention_to_hf(params, i, cfg))
            state.update(mlp_to_hf(params, i))
            for hf_name, name in norms.items():
                state[f"model.layers.{i}.{hf_name}.weight"] = params[f"layers.{i}.{name}.scale"]
        return state

    return to_hf_state


# Gemma 1's `post_attention_layernorm` is its pre-MLP norm
to_hf_state = decoder_to_hf({"input_layernorm": "pre_attention_norm", "post_attention_layernorm": "pre_ffw_norm"})


def _model_class():
    return gemma_lib.Gemma


GEMMA = Family(
    name="gemma",
    model_types=("gemma",),
    model_class=_model_class(),
    config_from_hf=config_from_hf,
    key_mapping=key_mapping,
    preprocess=preprocess,
    to_hf_state=to_hf_state,
)
