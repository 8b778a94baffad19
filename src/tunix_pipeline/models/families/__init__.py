"""Supported model families, looked up by config.json's `model_type`."""

from __future__ import annotations

from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.models.families.base import Family
from tunix_pipeline.models.families.gemma import GEMMA
from tunix_pipeline.models.families.gemma2 import GEMMA2
from tunix_pipeline.models.families.gemma3 import GEMMA3
from tunix_pipeline.models.families.llama import LLAMA
from tunix_pipeline.models.families.qwen import QWEN2, QWEN3

REGISTRY: dict[str, Family] = {t: f for f in (GEMMA, GEMMA2, GEMMA3, LLAMA, QWEN2, QWEN3) for t in f.model_types}


def family_for(hf_config: dict) -> Family:
    model_type = hf_config.get("model_type")
    if model_type not in REGISTRY:
        raise ModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[model_type]

