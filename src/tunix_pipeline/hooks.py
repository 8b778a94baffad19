"""Project hooks: JAX device set-up before any node, and one MLflow run per `kedro run`."""

from __future__ import annotations

import logging
import os

from kedro.framework.hooks import hook_impl
from pydantic import BaseModel

from tunix_pipeline.config import RuntimeParams, TrackingParams
from tunix_pipeline.runtime import configure_host_devices, initialize_distributed

log = logging.getLogger(__name__)


# credentials.yml entries -> the environment variables the hub clients read (never overriding one already set)
CREDENTIAL_ENV = {
    ("huggingface", "token"): "HF_TOKEN",
    ("kaggle", "username"): "KAGGLE_USERNAME",
    ("kaggle", "key"): "KAGGLE_KEY",
}


def export_credentials(config_loader) -> None:
    try:
        credentials = config_loader["credentials"]
    except Exception:  # no credentials file is fine
        return
    for (section, key), variable in CREDENTIAL_ENV.items():
        value = (credentials.get(section) or {}).get(key)
        if value:
            os.environ.setdefault(variable, str(value))


class ProjectHooks:
    def __init__(self):
        self._tracking: TrackingParams | None = None
        self._runtime: RuntimeParams | None = None
        self._params: dict = {}
        self._env: str | None = None
        self._project_path = None
        self._user_uri: str | None = None
        self._run = None

    @hook_impl
    def after_context_created(self, context) -> None:
        export_credentials(context.config_loader)
        # validated by Kedro against the nodes' pydantic hints, with --params overrides applied
        params = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in context.params.items()}
        self._runtime = RuntimeParams.model_validate(params.get("runtime", {}))
        configure_host_devices(self._runtime.host_device_count)
        initialize_distributed(self._runtime.distributed)
        self._tracking = TrackingParams.model_validate(params.get("tracking", {}))
        self._params = params
        self._env = context.env
        self._project_path = context.project_path

    @hook_impl
    def before_pipeline_run(self, run_params: dict, pipeline) -> None:
        import jax

        from tunix_pipeline import tracking
        from tunix_pipeline.training import make_mesh

        if "params:runtime" in pipeline.inputs():
            make_mesh(self._runtime)  # a mesh that cannot be built fails now, not after tokenizing

        if not self._tracking or not self._tracking.enabled or jax.process_index() != 0:
            return
        pipelines = run_params.get("pipeline_names") or [run_params.get("pipeline_name") or "__default__"]
        # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; put the user's back afterwards
        self._user_uri = os.environ.get("MLFLOW_TRACKING_URI")
        uri = tracking.tracking_uri(self._tracking, self._project_path)
        resume = None
        if "train_sft" in {node.name for node in pipeline.nodes}:
            # a killed or preempted training continues its own run: one curve, one value per step
            resume = tracking.unfinished_run(self._project_path / self._params["sft"]["checkpoint_dir"], uri)
        self._run = tracking.start_run(
            uri,
            self._tracking,
            self._params,
            tags={
                "kedro.env": run_params.get("env") or self._env,
                "kedro.pipelines": ",".join(p or "__default__" for p in pipelines),
                "kedro.session_id": run_params.get("session_id"),
                "mlflow.source.git.commit": tracking.git_commit(),
            },
            run_id=resume,
        )
        log.info("MLflow run %s in %s", self._run.info.run_id, uri)

    @hook_impl
    def after_node_run(self, node, outputs: dict) -> None:
        from tunix_pipeline import tracking

        if self._run is None:
            return
        for name, value in outputs.items():
            if name in self._tracking.log_outputs:
                tracking.log_output(name, value)

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._finish(failed=False)

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._finish(failed=True)

    def _finish(self, failed: bool) -> None:
        from tunix_pipeline import tracking

        if self._run is not None:
            tracking.end_run(failed)
            self._run = None
            if self._user_uri is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = self._user_uri
