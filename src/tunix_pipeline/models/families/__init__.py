"""Supported model families, looked up by config.json's `model_type`."""

from __future__ import annotations

from tunix_pipeline.models.errors import ModelError
from tunix_pipeline.models.families.base import Family

REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        REGISTRY[model_type] = family
    return family


def family_for(hf_config: dict) -> Family:
    model_type = hf_config.get("model_type")
    if model_type not in REGISTRY:
        raise ModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[model_type]


# Each module registers its families on import.
from tunix_pipeline.models.families import gemma  # noqa: E402,F401
from tunix_pipeline.models.families import llama, qwen  # noqa: E402,F401
from tunix_pipeline.models.families import gemma2, gemma3  # noqa: E402,F401
