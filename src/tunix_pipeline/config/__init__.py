"""Typed parameters: one pydantic model per `parameters_<stage>.yml` section, grouped by stage in this package.

Nodes type-hint their `params:` inputs with these models, so Kedro validates
the whole configuration before any node runs; unknown keys are errors
(`extra="forbid"`), which catches typos such as `max_step`. A field's default
is the value `conf/base` gives it (`tests/test_config_defaults.py`).
"""

from tunix_pipeline.config.base import Strict
from tunix_pipeline.config.data import (
    HubDataset, SourceParams, IngestParams, FormatParams, TokenizeParams,
)
from tunix_pipeline.config.model import (
    TinyModelParams, LoraParams, ModelParams,
)
from tunix_pipeline.config.training import (
    DEFAULT_LOSS_CHUNK, DistributedParams, RuntimeParams, OptimizerSettings, CheckpointSettings, DevEvalParams, SftParams,
)
from tunix_pipeline.config.evaluate import (
    HarnessParams, EvaluateParams, ExportParams, WandbParams, SystemMetricsParams, RegistryParams, TrackingParams,
)
from tunix_pipeline.config.polish import (
    JudgeParams, RewardParams, PromptFilterParams, GrpoParams, PairsFromRewardsParams, PreferenceParams,
)
from tunix_pipeline.config.plan import (
    HardwareProfile, PlanBudget, XlaCheckParams, PlanParams,
)

__all__ = [
    "Strict",
    "HubDataset",
    "SourceParams",
    "IngestParams",
    "FormatParams",
    "TokenizeParams",
    "TinyModelParams",
    "LoraParams",
    "ModelParams",
    "DistributedParams",
    "RuntimeParams",
    "DevEvalParams",
    "OptimizerSettings",
    "CheckpointSettings",
    "SftParams",
    "DEFAULT_LOSS_CHUNK",
    "HarnessParams",
    "EvaluateParams",
    "ExportParams",
    "WandbParams",
    "SystemMetricsParams",
    "RegistryParams",
    "TrackingParams",
    "JudgeParams",
    "RewardParams",
    "GrpoParams",
    "PromptFilterParams",
    "PairsFromRewardsParams",
    "PreferenceParams",
    "HardwareProfile",
    "PlanBudget",
    "XlaCheckParams",
    "PlanParams",
]
