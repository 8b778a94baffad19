"""The `export` pipeline."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
