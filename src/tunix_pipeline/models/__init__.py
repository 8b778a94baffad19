"""Base models as Hugging Face folders, loaded into Tunix's Flax NNX models and exported back.

A model is always a folder (config.json, *.safetensors, tokenizer files):
downloaded from the hub for real runs, or built here for offline runs (a tiny
Gemma with random weights and a tokenizer trained on the project's data).
The same loader reads both.
"""

from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.models.export import export_pretrained
from tunix_pipeline.models.hub import check_folder, load_tokenizer, read_hf_config, resolve_model_dir
from tunix_pipeline.models.loading import compute_logits, load_model, load_pretrained, model_summary, tunix_config
from tunix_pipeline.models.lora import apply_lora, load_run_model, merge_lora, parameter_counts
from tunix_pipeline.models.tiny import build_tiny_gemma

__all__ = [
    "ModelError",
    "apply_lora",
    "export_pretrained",
    "merge_lora",
    "parameter_counts",
    "build_tiny_gemma",
    "check_folder",
    "compute_logits",
    "load_model",
    "load_pretrained",
    "load_run_model",
    "load_tokenizer",
    "model_summary",
    "read_hf_config",
    "resolve_model_dir",
    "tunix_config",
]
