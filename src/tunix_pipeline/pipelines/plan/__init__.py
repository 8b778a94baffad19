"""The `plan` pipeline: will the run fit, how long, how much — before hardware is rented."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
