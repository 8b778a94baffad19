"""The `preference` pipeline: pairs, DPO / ORPO / SimPO from the SFT checkpoint, then the evaluation after it;
with `preference.enabled: false` SFT's checkpoint passes on."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
