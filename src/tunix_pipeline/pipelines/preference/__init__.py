"""The `preference` pipeline: pairs, DPO / ORPO / SimPO from the SFT checkpoint, then the evaluation after it."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
