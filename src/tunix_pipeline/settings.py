"""Kedro project settings."""

from tunix_pipeline.core import quiet

quiet.install()  # before the imports below and before Kedro builds its config loader: they warn

from tunix_pipeline.run.config_loader import ProjectConfigLoader  # noqa: E402
from tunix_pipeline.run.hooks import (  # noqa: E402
    CredentialHooks,
    OutputHooks,
    OutputRootHooks,
    PreflightHooks,
    RuntimeHooks,
    SessionHooks,
    TrackingHooks,
)

_tracking = TrackingHooks()
# one per concern; the order between them is set by tryfirst / trylast in run/hooks.py, not by this tuple
HOOKS = (OutputRootHooks(), CredentialHooks(), OutputHooks(), RuntimeHooks(), PreflightHooks(), _tracking, SessionHooks(_tracking))

# OmegaConfigLoader: an unknown --env named, conf/local over any environment, the session's parameters
CONFIG_LOADER_CLASS = ProjectConfigLoader
# "soft" merge: an environment overrides single keys, not whole sections. With no --env the smoke run's
# environment applies, so conf/base holds what every other environment can safely inherit.
CONFIG_LOADER_ARGS = {"base_env": "base", "default_run_env": "gpu_smoke", "merge_strategy": {"parameters": "soft"}}
