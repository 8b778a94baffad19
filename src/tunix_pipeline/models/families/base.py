"""What a model family provides to load and export Hugging Face checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from tunix_pipeline.core.errors import ModelError


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    # `model_type` values in config.json that this family reads
    model_types: tuple[str, ...]
    # the Tunix (Flax NNX) model class, or our subclass of it; built as model_class(config, rngs=...)
    model_class: type
    # config.json dict -> Tunix config; raises ModelError on a setting the model cannot honour
    config_from_hf: Callable[[dict], Any]
    # Tunix config -> {HF key regex: (Tunix key, (permute, reshape) | None)}, Tunix's format
    key_mapping: Callable[[Any], dict]
    # Tunix config -> a function fixing up each file's mapped tensors (e.g. fusing q/k/v), or None
    preprocess: Callable[[Any], Callable[[dict], dict]] | None
    # (flat Tunix params {"layers.0.attn.q_einsum.w": array}, Tunix config, config.json) -> HF tensors
    to_hf_state: Callable[[dict[str, np.ndarray], Any, dict], dict[str, np.ndarray]]
    # (Tunix config, dtype name) -> the config computing in that dtype, for a model whose layers cast their
    # weights and inputs to a configured dtype (Qwen's `ModelConfig.dtype`, float32 unless set); None: the
    # model computes in its weights' dtype (Gemma, Llama), which the loss casts to `sft.compute_dtype`
    with_compute_dtype: Callable[[Any, str], Any] | None = None


def require(condition: bool, family: str, setting: str, value, supported: str) -> None:
    """Refuses a checkpoint setting the Tunix model would silently ignore."""
    if not condition:
        raise ModelError(f"{family}: {setting}={value!r} is not supported ({supported})")


def rope_settings(hf: dict) -> dict:
    """Rope theta and scaling wherever the config keeps them (transformers 5: `rope_parameters`)."""
    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        rope = {**hf["rope_scaling"], **rope}
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", None) or "default")
    return rope


def linear_to_hf(kernel: np.ndarray) -> np.ndarray:
    """Flax kernel (in, out) -> torch Linear weight (out, in)."""
    return np.ascontiguousarray(kernel.T)
