"""Kedro project settings."""

from kedro.config import OmegaConfigLoader

from tunix_pipeline.hooks import ProjectHooks

HOOKS = (ProjectHooks(),)

CONFIG_LOADER_CLASS = OmegaConfigLoader
# "soft" merge: an environment overrides single keys, not whole sections.
CONFIG_LOADER_ARGS = {"base_env": "base", "default_run_env": "local", "merge_strategy": {"parameters": "soft"}}
