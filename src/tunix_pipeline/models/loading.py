"""Hugging Face folders -> Tunix models on a mesh, and their logits."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models import safetensors_loader
from tunix.sft import utils as sft_utils

from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.core.processes import host_array
from tunix_pipeline.models.families import Family, family_for
from tunix_pipeline.models.hub import check_folder, load_tokenizer, read_hf_config

# model -> (family, config.json) of the checkpoint it came from, for export
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tunix_config(folder: str | Path):
    """(family, Tunix config) for a folder, checked against what the family supports."""
    hf = read_hf_config(folder)
    family = family_for(hf)
    return family, family.config_from_hf(hf)


REMAT = {"none": "NONE", "attention": "BLOCK", "decoder": "DECODER"}


def run_config(family: Family, hf: dict, remat: str = "none", compute_dtype: str | None = None):
    """The Tunix config a run builds: `remat` (none, attention: recompute each attention block, decoder: each
    whole layer in the backward pass; Tunix's RematConfig) and, where the family takes one, the dtype it
    computes in (else the model computes in its weights' dtype)."""
    cfg = family.config_from_hf(hf)
    if remat != "none":
        cfg = dataclasses.replace(cfg, remat_config=type(cfg.remat_config)[REMAT[remat]])
    if compute_dtype and family.with_compute_dtype is not None:
        cfg = family.with_compute_dtype(cfg, compute_dtype)
    return cfg


def load_model(folder: str | Path, mesh: jax.sharding.Mesh | None, dtype: str = "float32", remat: str = "none",
               compute_dtype: str | None = None):
    """(Tunix model with the folder's weights in `dtype`, sharded over `mesh`, its Tunix config).

    `remat` and `compute_dtype` (default: `dtype`) as `run_config` takes them.
    """
    folder = Path(folder)
    check_folder(folder)
    hf = read_hf_config(folder)
    family = family_for(hf)
    cfg = run_config(family, hf, remat, compute_dtype or dtype)
    if mesh is not None:
        _check_divisible(cfg, mesh)
    model = safetensors_loader.load_and_create_model(
        file_dir=str(folder),
        model_class=family.model_class,
        config=cfg,
        key_mapping=family.key_mapping,
        mesh=mesh,
        preprocess_fn=family.preprocess(cfg) if family.preprocess else None,
        dtype=jnp.dtype(dtype),
        # the "optimized" reader fails on files that mix dtypes
        mode="original",
    )
    _check_complete(model, folder)
    remember_origin(model, family, hf)
    return model, cfg


def _check_complete(model, folder: Path) -> None:
    """Every weight came from the checkpoint (Tunix's loader leaves missing ones abstract)."""
    missing = [
        ".".join(map(str, path))
        for path, value in nnx.to_flat_state(nnx.state(model))
        if isinstance(value.get_value() if isinstance(value, nnx.Variable) else value, jax.ShapeDtypeStruct)
    ]
    if missing:
        raise ModelError(
            f"{folder}: the checkpoint has no weights for {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            + " (is config.json's tie_word_embeddings or model_type right?)"
        )


def remember_origin(model, family: Family, hf: dict) -> None:
    _ORIGINS[model] = (family, hf)


def has_origin(model) -> bool:
    return model in _ORIGINS


def origin_of(model) -> tuple[Family, dict]:
    if model not in _ORIGINS:
        raise ModelError("this model was not loaded with load_pretrained/load_model; pass hf_config= to export it")
    return _ORIGINS[model]


def load_pretrained(path: str | Path, mesh: jax.sharding.Mesh | None = None, dtype: str = "float32"):
    """(model, tokenizer) from a Hugging Face folder; the tokenizer is None when the folder has none."""
    model, _ = load_model(path, mesh, dtype)
    return model, load_tokenizer(path)


def compute_logits(model, tokens: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Logits (B, L, V) float32 for right-padded `tokens` (B, L) with a 0/1 `attention_mask`."""
    mask = jnp.asarray(attention_mask).astype(bool)
    positions = sft_utils.build_positions_from_mask(mask)
    logits, _ = _forward(model, jnp.asarray(tokens, jnp.int32), positions, sft_utils.make_causal_attn_mask(mask))
    return np.asarray(host_array(logits), dtype=np.float32)


def _forward(model, tokens, positions, attention):
    return nnx.jit(lambda m, t, p, a: m(t, p, None, a))(model, tokens, positions, attention)


def _check_divisible(cfg, mesh) -> None:
    tp, fsdp = mesh.shape.get("tp", 1), mesh.shape.get("fsdp", 1)
    vocab = getattr(cfg, "num_embed", None) or getattr(cfg, "vocab_size", None)
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads={cfg.num_heads} is not divisible by tp={tp}")
    if cfg.num_kv_heads > 1 and cfg.num_kv_heads % tp:
        problems.append(f"num_kv_heads={cfg.num_kv_heads} is not divisible by tp={tp}")
    if vocab % tp:
        problems.append(f"vocab size {vocab} is not divisible by tp={tp}")
    if cfg.embed_dim % fsdp:
        problems.append(f"hidden size {cfg.embed_dim} is not divisible by fsdp={fsdp}")
    if problems:
        raise ModelError(f"the model does not shard over mesh {dict(mesh.shape)}: {'; '.join(problems)}")


def model_summary(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, (int, float, str, bool))}
