"""Project hooks, one class per concern: one writer per output root, credentials, whole outputs, JAX devices and the
mesh, the stages' settings checked before the first node (`preflight`), the MLflow run, the session ledger.

Each reads its own sections of the parameters in `after_context_created`. Where two must run in an order
(the ledger refuses a finished plan before anything starts, and records the MLflow run before it ends),
`tryfirst` / `trylast` say so. Nodes are found by the names `tunix_pipeline.pipelines` defines.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from etils import epath
from kedro.framework.hooks import hook_impl
from kedro.framework.project import pipelines, settings
from kedro.validation.exceptions import ParameterValidationError
from pydantic import BaseModel

from tunix_pipeline.config import RuntimeParams, SourceParams, TrackingParams
from tunix_pipeline.config.validation import check_parameters, validate_section
from tunix_pipeline.core.command import kedro_command
from tunix_pipeline.core.errors import TrainingInterrupted
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.run.output_lock import acquire
from tunix_pipeline.run.sessions import Ledger, SessionPlanDone, SessionsParams, brief, expectation, over_weekly_budget
from tunix_pipeline.stages import POLISH, SFT, STAGES, TRAINING_NODES

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


def context_params(context) -> dict:
    """The run's parameters as plain dicts: validated by Kedro against the nodes' pydantic hints, with --params
    overrides applied. A bad one is a `ConfigError` of one line (Kedro's own message spans pydantic's report)."""
    try:
        params = context.params
    except ParameterValidationError:
        check_parameters(context.config_loader["parameters"], pipelines)  # raises the one-line error
        raise
    return {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in params.items()}


def trains(pipeline) -> bool:
    return SFT.train_node in {node.name for node in pipeline.nodes}


class CredentialHooks:
    @hook_impl
    def after_context_created(self, context) -> None:
        export_credentials(context.config_loader)


class OutputHooks:
    """Each output a node is about to write is saved whole or not at all (`upstream.atomic_saves`)."""

    @hook_impl
    def before_node_run(self, node, catalog) -> None:
        from tunix_pipeline.upstream import atomic_saves  # start-up (core/__init__.py): Tunix, JAX

        for name in node.outputs:
            atomic_saves(catalog.get(name))  # None: a memory output the runner adds later


class OutputRootHooks:
    """One writer per output root (`output_lock`): taken before the first node and before MLflow's store opens (the
    second run stops before it writes anything), let go after the MLflow run ends; on process 0 of a multi-host run.
    First in `settings.HOOKS`: the last of the `tryfirst` hooks to be called, and of the `trylast` ones."""

    def __init__(self):
        self._root: Path | None = None
        self._lock = None

    @hook_impl
    def after_context_created(self, context) -> None:
        root = validate_section(context_params(context), "runtime", RuntimeParams).output_root
        self._root = None if "://" in root else context.project_path / root  # a bucket has no lock files

    @hook_impl(tryfirst=True)
    def before_pipeline_run(self, run_params: dict) -> None:
        from tunix_pipeline.core.processes import on_main_process  # start-up (core/__init__.py): JAX

        self._release()  # an earlier run of this process that Kedro did not end (a notebook cell interrupted)
        if self._root is not None:
            self._lock = on_main_process("output root lock", lambda: acquire(self._root, kedro_command(run_params)))

    @hook_impl(trylast=True)
    def after_pipeline_run(self) -> None:
        self._release()

    @hook_impl(trylast=True)
    def on_pipeline_error(self) -> None:
        self._release()

    def interrupted(self) -> None:
        """A run ended by Ctrl-C outside training's own stop (Kedro hands its hooks exceptions, not interrupts)."""
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class RuntimeHooks:
    """JAX's devices before any node; the mesh and the shared checkpoint folders checked before the first node; host
    memory handed back before each training stage."""

    def __init__(self):
        self._params: dict = {}
        self._runtime: RuntimeParams | None = None

    @hook_impl
    def after_context_created(self, context) -> None:
        from tunix_pipeline.core import runtime  # start-up (core/__init__.py): JAX

        self._params = context_params(context)
        self._runtime = validate_section(self._params, "runtime", RuntimeParams)
        runtime.configure_host_devices(self._runtime.host_device_count)
        runtime.initialize_distributed(self._runtime.distributed)

    @hook_impl
    def before_pipeline_run(self, pipeline) -> None:
        from tunix_pipeline.core import runtime  # start-up (core/__init__.py): JAX

        if "params:runtime" in pipeline.inputs():
            runtime.make_mesh(self._runtime)  # a mesh that cannot be built fails now, not after tokenizing
        # multi-host: a checkpoint folder that is not shared stops the run in seconds, not in Orbax after minutes
        runtime.check_shared_folders(runtime.orbax_folders(self._params, (node.name for node in pipeline.nodes)),
                                     self._runtime.shared_folder_timeout_s)

    @hook_impl
    def before_node_run(self, node) -> None:
        from tunix_pipeline.core import runtime  # start-up (core/__init__.py): JAX

        if node.name in TRAINING_NODES:  # the nodes share one process: a stage starts without what the ones before
            runtime.hand_back_host_memory()  # it freed or left in reference cycles


class PreflightHooks:
    """The settings of every stage the run will reach (rewards, judges, lm-eval tasks, the checkpoints it starts
    from, lengths) and the earlier stages' outputs it reads, checked before the first node: a misspelt setting or
    a missing input stops the run in seconds, not after SFT."""

    def __init__(self):
        self._params: dict = {}

    @hook_impl
    def after_context_created(self, context) -> None:
        self._params = context_params(context)

    @hook_impl
    def before_pipeline_run(self, pipeline, catalog) -> None:
        from tunix_pipeline.run import preflight  # start-up (core/__init__.py): the planner, JAX, Tunix

        preflight.check_inputs_written(pipeline, catalog, pipelines)
        preflight.check_reached_stages(self._params, (node.name for node in pipeline.nodes))


def _mlflow_runs():
    """`tracking.mlflow_runs`, imported by the first hook that tracks a run."""
    from tunix_pipeline.tracking import mlflow_runs  # start-up (core/__init__.py): MLflow, transformers

    return mlflow_runs


def session_tags(sessions: SessionsParams) -> dict:
    """The MLflow tags of a run of the training session `sessions.current`."""
    current = sessions.current
    if current is None:
        return {}
    parent = current.parent or {}
    return {"session.name": current.name, "session.index": str(current.index + 1), "session.parent": parent.get("session")}


class TrackingHooks:
    """One MLflow run per `kedro run` (on process 0): outputs, data splits, system metrics, the exported model."""

    def __init__(self):
        self._params: dict = {}
        self._tracking: TrackingParams | None = None
        self._sessions: SessionsParams | None = None
        self._env: str | None = None
        self._project_path: Path | None = None
        self._user_uri: str | None = None
        self._run = None
        self._monitor = None

    @property
    def run_id(self) -> str | None:
        """The MLflow run of the pipeline run in progress; None when tracking is off."""
        return self._run.info.run_id if self._run is not None else None

    @hook_impl
    def after_context_created(self, context) -> None:
        self._params = context_params(context)
        self._tracking = validate_section(self._params, "tracking", TrackingParams)
        self._sessions = validate_section(self._params, "sessions", SessionsParams)
        self._env = context.env
        self._project_path = context.project_path

    @hook_impl(trylast=True)  # after the session's refusal and the mesh check: no MLflow run for a run that cannot start
    def before_pipeline_run(self, run_params: dict, pipeline) -> None:
        from tunix_pipeline.core.processes import is_main_process  # start-up (core/__init__.py): JAX

        if not self._tracking or not self._tracking.enabled or not is_main_process():
            return
        mlflow_runs = _mlflow_runs()
        training = trains(pipeline)
        pipelines = ",".join(p or "__default__" for p in run_params.get("pipeline_names") or [run_params.get("pipeline_name")])
        env = run_params.get("env") or self._env or settings.CONFIG_LOADER_ARGS["default_run_env"]
        # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; put the user's back afterwards
        self._user_uri = os.environ.get("MLFLOW_TRACKING_URI")
        uri = mlflow_runs.tracking_uri(self._tracking, self._project_path)
        # The run a rerun follows: for --only-missing-outputs / --from-nodes / --to-nodes the last run of this
        # output root; for another run that trains, the run recorded beside the checkpoints it resumes
        output_root = validate_section(self._params, "runtime", RuntimeParams).output_root
        if mlflow_runs.is_restart(run_params):
            previous = mlflow_runs.recorded_run(self._local(output_root), uri)
        else:
            previous = mlflow_runs.recorded_run(self._local(self._params[SFT.name]["checkpoint_dir"]), uri) if training else None
        resume, lineage = None, {}
        if previous is not None:
            digest = mlflow_runs.config_digest(mlflow_runs.config_yaml(self._params))
            resume, lineage = mlflow_runs.restart_rule(uri, previous, env, digest)
        self._run = mlflow_runs.start_run(
            uri,
            self._tracking,
            self._params,
            tags={
                "kedro.env": env,
                "kedro.pipelines": pipelines,
                "kedro.session_id": run_params.get("session_id"),
                mlflow_runs.COMMAND_TAG: kedro_command(run_params),
                "mlflow.source.git.commit": mlflow_runs.git_commit(),
                **(session_tags(self._sessions) if training else {}),
                **lineage,
            },
            run_id=resume,
            run_name=f"{pipelines}@{env}",
        )
        mlflow_runs.remember_run(self._local(output_root))
        if resume:
            log.info("MLflow run %s continued (restart of an unfinished run with the same configuration) in %s",
                     resume, uri)
        else:
            log.info("MLflow run %s in %s%s", self._run.info.run_id, uri,
                     f" (restart of run {lineage['lineage.restart_of']})" if lineage else "")

    def _local(self, path: str) -> epath.Path:
        """A configured folder as a path: a URI as it is, a relative path under the project."""
        return storage_path(path if "://" in str(path) else self._project_path / path)

    @hook_impl
    def before_node_run(self, node) -> None:
        if self._run is not None and node.name in TRAINING_NODES:  # MLflow's system metrics, sampled while they run
            self._monitor = _mlflow_runs().system_metrics_monitor(self._tracking)

    @hook_impl
    def after_node_run(self, node, catalog, outputs: dict) -> None:
        mlflow_runs = _mlflow_runs()
        self._stop_monitor()
        if self._run is None:
            return
        for name, value in outputs.items():
            if name in self._tracking.log_outputs:
                mlflow_runs.log_output(name, value)
        splits = {name: outputs[name] for name in ("train_records", "eval_records") if name in outputs}
        if splits:
            # the saved file is the dataset's source (kedro-datasets describe their path only in _describe())
            files = {name: catalog[name]._describe().get("filepath") for name in splits}
            mlflow_runs.log_splits(splits, files, [SourceParams.model_validate(s) for s in self._params["ingest"]["sources"]])
        exported = outputs.get("exported_model")
        if exported and self._tracking.register_model.enabled:
            if "://" in exported["path"]:  # MLflow logs a model from a local folder
                log.info("export in %s: not registered in MLflow (a local export.output_dir is)", exported["path"])
                return
            base = catalog.load("base_model") if catalog.exists("base_model") else None
            version = mlflow_runs.register_model(exported, self._tracking.register_model, base)
            log.info("exported model registered in MLflow as %s", version["uri"])

    @hook_impl
    def on_node_error(self) -> None:
        self._stop_monitor()

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None

    @hook_impl(trylast=True)  # after the session ledger recorded this run's id
    def after_pipeline_run(self) -> None:
        self._finish("FINISHED")

    @hook_impl(trylast=True)
    def on_pipeline_error(self, error) -> None:
        mlflow_runs = _mlflow_runs()
        if isinstance(error, TrainingInterrupted):  # a stop that saved, not a failure: MLflow's KILLED, and where
            self._finish("KILLED", mlflow_runs.stop_tags(error.signal_name, error.step, error.checkpoint_dir))
        else:
            self._finish("FAILED")

    def interrupted(self) -> None:
        """A run ended by Ctrl-C outside training's own stop: its MLflow run ends KILLED, not left active."""
        self._finish("KILLED")

    def _finish(self, status: str, tags: dict | None = None) -> None:
        mlflow_runs = _mlflow_runs()
        self._stop_monitor()
        if self._run is not None:
            mlflow_runs.end_run(status, tags)
            self._run = None
            if self._user_uri is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = self._user_uri


class SessionHooks:
    """The training session of `sessions.plan` (tunix_pipeline.run.sessions): what it will do, and its ledger entry."""

    def __init__(self, tracking: TrackingHooks):
        self._tracking = tracking  # the MLflow run id goes into the ledger
        self._params: dict = {}
        self._sessions: SessionsParams | None = None
        self._results: dict = {}
        self._started = 0.0

    @hook_impl
    def after_context_created(self, context) -> None:
        self._params = context_params(context)
        self._sessions = validate_section(self._params, "sessions", SessionsParams)

    def _output_root(self) -> str:
        return validate_section(self._params, "runtime", RuntimeParams).output_root

    def _ledger(self) -> Ledger:
        return Ledger.load(self._output_root(), self._sessions.previous_root)

    @hook_impl(tryfirst=True)  # a finished plan is refused before the mesh is built or an MLflow run starts
    def before_pipeline_run(self, pipeline) -> None:
        """Says what this session will do; refuses when the plan is done."""
        self._results, self._started = {}, 0.0  # the hooks object outlives a run (notebooks, tests): nothing carries over
        current = self._sessions.current if self._sessions else None
        if current is None or not trains(pipeline):
            return
        if current.plan_done:
            raise SessionPlanDone(
                f"every session of sessions.plan is finished (ledger: {self._output_root()}/sessions.json); "
                "add a session to the plan, or set runtime.output_root to a new folder to start over"
            )
        ledger = self._ledger()
        log.info("%s", brief(self._sessions, ledger, self._params[SFT.name]))
        if over_weekly_budget(self._sessions, ledger):
            log.warning("session '%s' (%g h) runs past the weekly budget of %g h: Kaggle may stop it",
                        current.name, current.hours, self._sessions.weekly_hours)
        self._started = time.time()

    @hook_impl
    def after_node_run(self, outputs: dict) -> None:
        self._results.update({k: v for k, v in outputs.items() if k in {stage.result for stage in STAGES}})
        planned = (outputs.get("sft_plan") or {}).get("hours")
        if planned is not None and self._started and self._sessions.current:
            message, over = expectation(self._sessions, self._ledger(), planned)
            log.log(logging.WARNING if over else logging.INFO, "%s", message)

    @hook_impl(tryfirst=True)  # before the MLflow run ends
    def after_pipeline_run(self, catalog) -> None:
        self._end(catalog, failed=False)

    @hook_impl(tryfirst=True)
    def on_pipeline_error(self, catalog, error) -> None:
        self._end(catalog, failed=True, stopped=isinstance(error, TrainingInterrupted))

    def _end(self, catalog, failed: bool, stopped: bool = False) -> None:
        """Records the run in the ledger; the session is finished once its SFT (preference, GRPO) reached their steps."""
        from tunix_pipeline.core.processes import is_main_process  # start-up (core/__init__.py): JAX
        from tunix_pipeline.train.final_weights import keep_for_next_session  # start-up: Orbax, JAX

        current = self._sessions.current if self._sessions else None
        if current is None or not self._started or not is_main_process():
            return
        sft = self._results.get(SFT.result)
        polish = {stage.name: self._results.get(stage.result) or {} for stage in POLISH}
        finished = not failed and sft is not None and not sft.get("stopped_early") \
            and sft["latest_step"] is not None and not any(r.get("stopped_early") for r in polish.values())
        ledger = self._ledger()
        run_id = self._tracking.run_id
        outcome = "stopped" if stopped or not (failed or finished) else "failed" if failed else "finished"
        ledger.record_run(current.name, self._started, time.time() - self._started, run_id, outcome)
        if finished:
            entry = {"run_id": run_id, "checkpoint_dir": sft["checkpoint_dir"], "step": sft["latest_step"]}
            base = catalog.load("base_model") if catalog.exists("base_model") else {}
            if base.get("source") == "tiny" or Path(base.get("source", "")).is_dir():
                entry["base_model_dir"] = base["path"]  # a local model (built: tiny): the next session needs this one
            for name, result in polish.items():  # the policies the session trained, for the next one to start from
                if result.get("enabled"):
                    entry.update({f"{name}_checkpoint_dir": result["checkpoint_dir"], f"{name}_step": result["latest_step"]})

            entry = keep_for_next_session(entry, self._output_root(), current.name)
            ledger.record_finished(current.index, current.name, entry)
            log.info("session '%s' finished; the next `kedro run` starts the next session of the plan", current.name)
