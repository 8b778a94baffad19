"""The `grpo` pipeline: GRPO from the policy before it (the preference stage's, or SFT's), then the evaluation
after it; with `grpo.enabled: false` the policy passes through."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
