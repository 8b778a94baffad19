"""MLflow tracking: the run's lifecycle, a Tunix metrics backend, and node outputs.

Only JAX process 0 talks to MLflow. The default store is the embedded
`sqlite:///<output_root>/mlflow.db`, artifacts beside it in `mlruns/`;
`MLFLOW_TRACKING_URI` points at a server instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import transformers
import yaml
from etils import epath
from huggingface_hub import HfApi, ModelCard, constants
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from tunix_pipeline.config import RegistryParams, SourceParams, TrackingParams
from tunix_pipeline.core.command import flatten

MAX_PARAM_LENGTH = 6000  # MLflow's limit on one parameter value
MAX_TAG_LENGTH = 8000  # and on one tag value
MAX_NAME_LENGTH = 250  # MLflow's limit on a metric, parameter or tag name
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_\-.:/]")  # MLflow also allows spaces; "_" keeps names one word


def mlflow_name(name: str) -> str:
    """`name` made valid as an MLflow metric, parameter or tag name, or an artifact path.

    MLflow allows letters, digits and `_-. :/`, at most 250 characters, and no name that
    would resolve to another as a path (`a//b`, `a/./b`, `../a`, `/a`, `a/`). Every name
    that reaches MLflow goes through here: they hold source names, columns and reasons from
    user data. Valid names are returned unchanged.
    """
    parts = [_NAME_CHARS.sub("_", part) for part in str(name).split("/") if part]
    parts = ["_" * len(part) if not part.strip(".") else part for part in parts]  # "." and ".." segments
    name = "/".join(parts) or "_"
    if name.startswith("."):
        name = "_" + name[1:]
    if len(name) > MAX_NAME_LENGTH:  # cut, with a hash of the whole so that long names stay distinct
        name = name[: MAX_NAME_LENGTH - 9].rstrip("/") + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def tracking_uri(params: TrackingParams, project_path: Path) -> str:
    """MLFLOW_TRACKING_URI, else the configured URI with a relative sqlite path made absolute.

    Absolute because MLflow caches stores by URI: a relative one would keep
    pointing at the first project used in the process.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix) :]).is_absolute():
        uri = prefix + str((project_path / uri[len(prefix) :]).resolve())
    return uri


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# ---------------------------------------------------------------- what a run is: its configuration and command
DIGEST_TAG = "config.digest"
COMMAND_TAG = "kedro_command"
RESTART_COMMAND_TAG = "kedro_restart_command"
_SECRET_KEY = re.compile(r"(token|password|passwd|secret|api_key|access_key|private_key)$", re.I)
_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")


def redacted(tree):
    """`tree` with credentials blanked: values of keys named like a secret, and `user:password@` in URLs."""
    if isinstance(tree, Mapping):
        return {k: "<redacted>" if v and _SECRET_KEY.search(str(k)) else redacted(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redacted(v) for v in tree]
    if isinstance(tree, str):
        return _URL_USERINFO.sub(r"\1<redacted>@", tree)
    return tree


def config_yaml(params: Mapping) -> str:
    """The resolved parameters (environment merged, --params applied) as one YAML file, credentials blanked."""
    return yaml.safe_dump(_jsonable(redacted(params)), sort_keys=True, allow_unicode=True)


def config_digest(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()


def is_restart(run_params: Mapping) -> bool:
    """A rerun that picks up where an earlier run stopped: --only-missing-outputs, --from-nodes, --to-nodes."""
    return bool(run_params.get("only_missing_outputs") or run_params.get("from_nodes") or run_params.get("to_nodes"))


def restart_rule(uri: str, previous_run_id: str, env: str, digest: str) -> tuple[str | None, dict]:
    """(the run to continue, or None; tags for a new run). The rule for a rerun that follows `previous_run_id`:

    continue it when it did not finish and has this environment and this configuration digest;
    otherwise open a new run tagged `lineage.restart_of=<previous run id>`.
    """
    try:
        previous = mlflow.MlflowClient(tracking_uri=uri).get_run(previous_run_id)
    except Exception:  # deleted, or another store
        return None, {}
    tags = previous.data.tags
    if previous.info.status != "FINISHED" and tags.get("kedro.env") == env and tags.get(DIGEST_TAG) == digest:
        return previous.info.run_id, {}
    return None, {"lineage.restart_of": previous.info.run_id}


def start_run(uri: str, params: TrackingParams, all_params: Mapping, tags: Mapping[str, str], run_id: str | None = None,
              run_name: str | None = None):
    """A new MLflow run, or the unfinished run `run_id` continued (a restart; see `restart_rule`).

    Parameters are the resolved configuration (also logged whole as `config/parameters.yml`, with the
    installed package versions as `config/packages.json`). A continued run keeps its first command and
    gets the restart's command as `kedro_restart_command`.
    """
    mlflow.set_tracking_uri(uri)
    if uri.startswith("sqlite:///") and mlflow.get_experiment_by_name(params.experiment) is None:
        # artifacts beside the store (not in the working directory), so the output root holds everything
        artifacts = Path(uri[len("sqlite:///") :]).parent / "mlruns" / params.experiment
        mlflow.create_experiment(params.experiment, artifact_location=str(artifacts))
    mlflow.set_experiment(params.experiment)
    config = config_yaml(all_params)
    flat = {mlflow_name(k): str(v) for k, v in flatten(redacted(all_params)).items()}
    tags = {**tags, DIGEST_TAG: config_digest(config)}
    if run_id is not None:
        logged = mlflow.MlflowClient().get_run(run_id).data.params
        changed = sorted(k for k in flat if k in logged and logged[k] != _fitted(flat[k], k, MAX_PARAM_LENGTH))
        flat = {k: v for k, v in flat.items() if k not in logged}  # MLflow refuses to change a parameter
        tags = {**tags, "resumed": "true", "resumed_with_changed_params": ",".join(changed) or None,
                RESTART_COMMAND_TAG: tags.get(COMMAND_TAG)}
        tags.pop(COMMAND_TAG, None)  # the run keeps the command that started it
        run_name = None
    run = mlflow.start_run(run_id=run_id, run_name=run_name)
    if run_id is not None:  # where a stop left it (`stop_tags`) is over once it goes on
        for key in [k for k in run.data.tags if k.startswith("stopped.")]:
            mlflow.delete_tag(key)
    set_tags(tags)
    log_params(flat)
    mlflow.log_text(config, "config/parameters.yml")
    mlflow.log_dict(package_versions(), "config/packages.json")
    return run


def _fitted(value: str, name: str, limit: int) -> str:
    """`value`, or, when MLflow's limit would cut it, where the whole value is (an artifact)."""
    return value if len(value) <= limit else f"<{len(value)} characters: artifact {_overflow_path(name)}>"


def _overflow_path(name: str) -> str:
    return mlflow_name(f"long_values/{name}.txt")


def log_params(params: Mapping[str, str]) -> None:
    """Logs parameters; a value too long for MLflow is logged whole as an artifact and named in the parameter."""
    for name, value in params.items():
        if len(value) > MAX_PARAM_LENGTH:
            mlflow.log_text(value, _overflow_path(name))
    mlflow.log_params({name: _fitted(value, name, MAX_PARAM_LENGTH) for name, value in params.items()})


def set_tags(tags: Mapping[str, str | None]) -> None:
    """Sets tags (None: not set); a value too long for MLflow is logged whole as an artifact and named in the tag."""
    tags = {mlflow_name(k): str(v) for k, v in tags.items() if v is not None}
    for name, value in tags.items():
        if len(value) > MAX_TAG_LENGTH:
            mlflow.log_text(value, _overflow_path(name))
    mlflow.set_tags({name: _fitted(value, name, MAX_TAG_LENGTH) for name, value in tags.items()})


KEY_PACKAGES = (
    "tunix_pipeline", "google-tunix", "jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax", "optax",
    "orbax-checkpoint", "qwix", "transformers", "tokenizers", "safetensors", "datasets", "huggingface_hub", "gguf",
    "mlflow", "kedro", "kedro-datasets", "numpy", "pandas", "pyarrow", "pydantic", "torch",
)


def package_versions() -> dict:
    """Python and the installed versions of the packages a run's results depend on (absent ones left out)."""
    packages = {}
    for name in KEY_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    return {"python": platform.python_version(), "platform": platform.platform(), "packages": packages}


RUN_FILE = "mlflow_run.json"


def remember_run(folder: epath.Path) -> None:
    """Records the active run in `folder` (beside checkpoints, or in the output root; local or gs://), so that a
    rerun finds it."""
    run = mlflow.active_run()
    if run is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_FILE).write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}))


def record_lineage(lineage: Mapping, parent: epath.Path | None, checkpoint_dir: epath.Path | None) -> dict:
    """A training stage's start: its lineage (`sft.init_from`'s `parent` folder, None: none) with the parent's MLflow
    run, returned and, on the active run (process 0's), set as `lineage.*` tags; this run recorded beside
    `checkpoint_dir` (None: nothing is trained there this session)."""
    lineage = {**lineage, "parent_run_id": recorded_run(parent)} if parent is not None else dict(lineage)
    if mlflow.active_run() is not None:
        set_tags({f"lineage.{k}": v for k, v in lineage.items()})
        if checkpoint_dir is not None:
            remember_run(checkpoint_dir)
    return lineage


def recorded_run(folder: epath.Path, uri: str | None = None) -> str | None:
    """The MLflow run recorded in `folder` (None when there is none, or, given `uri`, it is in another store)."""
    path = folder / RUN_FILE
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text())
    return recorded["run_id"] if uri is None or recorded.get("tracking_uri") == uri else None


# ---------------------------------------------------------------- inputs, system metrics, the model
def log_splits(splits: Mapping[str, pd.DataFrame], files: Mapping[str, str | None], sources: list[SourceParams]) -> None:
    """The ingested splits as MLflow datasets (`mlflow.log_input`): source file, digest, schema, rows.

    The digest is a sha256 of every row (MLflow's own covers the first 10,000); each input is tagged
    with the sources it was built from, a hub dataset with its revision.
    """
    origins = {mlflow_name(f"origin.{source.name}"): _origin(source) for source in sources}
    for name, frame in splits.items():
        rows = frame.to_json(orient="records", lines=True, force_ascii=False)
        source = resolve_dataset_source(Path(files[name]).resolve().as_uri() if files.get(name) else name)
        dataset = mlflow.data.from_pandas(frame, source=source, name=name, digest=hashlib.sha256(rows.encode()).hexdigest()[:16])
        mlflow.log_input(dataset, context="training" if name.startswith("train") else "evaluation", tags=origins)


def _origin(source: SourceParams) -> str:
    """Where a source's rows came from: its file, or `hf:<path>[<name>]/<split>@<revision>`."""
    if source.hf is None:
        return str(source.path)
    hf = source.hf
    return f"hf:{hf.path}{f'[{hf.name}]' if hf.name else ''}/{hf.split}@{hub_revision(hf.path, hf.revision)}"


def hub_revision(path: str, revision: str | None) -> str:
    """The commit a hub dataset was read at: the configured revision, else the hub's current one; a local folder: 'local'."""
    if Path(path).exists():
        return "local"

    if constants.HF_HUB_OFFLINE:
        return revision or "unknown (offline)"
    try:
        return HfApi().dataset_info(path, revision=revision, timeout=10).sha or revision or "unknown"
    except Exception as err:  # the hub is unreachable or the token lacks access: the run goes on without it
        return f"{revision or 'unknown'} (hub: {type(err).__name__})"


def system_metrics_monitor(params: TrackingParams):
    """MLflow's monitor of CPU, memory, disk, network (and GPU with nvidia-ml-py) for the active run, started;
    None when off or when no run is active. `finish()` stops it."""
    run = mlflow.active_run()
    if run is None or not params.system_metrics.enabled:
        return None

    monitor = SystemMetricsMonitor(
        run.info.run_id, sampling_interval=params.system_metrics.interval_s, resume_logging=True,
        tracking_uri=mlflow.get_tracking_uri(),
    )
    monitor.start()
    return monitor


def register_model(exported: Mapping, registry: RegistryParams, base_model: Mapping | None) -> Mapping | None:
    """Logs the exported Hugging Face folder as an MLflow model (transformers flavour, text generation) and
    registers it as a new version of `registry.name`, tagged with the run's lineage. Returns its version."""
    run = mlflow.MlflowClient().get_run(mlflow.active_run().info.run_id)  # its tags as they are now
    source = (base_model or {}).get("source", "unknown")
    card = ModelCard(
        f"---\nlicense: that of the base model ({source})\n---\n"
        f"# {registry.name}\n\nFine-tuned by tunix_pipeline from `{source}` in MLflow run {run.info.run_id} "
        f"({exported.get('stage')} checkpoint, step {exported.get('checkpoint_step')}).\n"
    )
    requirements = [f"transformers=={transformers.__version__}", "torch", "accelerate"]
    for package in ("tokenizers", "safetensors"):
        requirements.append(f"{package}=={metadata.version(package)}")
    info = mlflow.transformers.log_model(
        transformers_model=str(exported["path"]), name="model", task="text-generation", model_card=card,
        pip_requirements=requirements, registered_model_name=registry.name,
    )
    version = info.registered_model_version
    client = mlflow.MlflowClient()
    lineage = {k: v for k, v in run.data.tags.items() if k.startswith(("kedro.", "lineage.", "session.", "config."))}
    lineage.update({"mlflow.source.git.commit": run.data.tags.get("mlflow.source.git.commit"),
                    "stage": exported.get("stage"), "checkpoint_step": exported.get("checkpoint_step"),
                    "base_model": source})
    for key, value in lineage.items():
        if value is not None:
            client.set_model_version_tag(registry.name, version, mlflow_name(key), str(value)[:MAX_TAG_LENGTH])
    mlflow.set_tag("registered_model", f"models:/{registry.name}/{version}")
    return {"name": registry.name, "version": version, "uri": f"models:/{registry.name}/{version}"}


def stop_tags(signal_name: str, step: int, checkpoint_dir: str) -> dict:
    """The tags of a run a signal stopped after saving (ended as KILLED)."""
    return {"stopped.signal": signal_name, "stopped.step": str(step), "stopped.checkpoint_dir": checkpoint_dir}


def end_run(status: str, tags: dict | None = None) -> None:
    """Ends the active run as `status` (FINISHED, FAILED, KILLED), with `tags` set first."""
    if mlflow.active_run() is not None:
        if tags:
            mlflow.set_tags(tags)
        mlflow.end_run(status=status)


def numeric(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(float(value)):
        return float(value)
    return None


# Keys in node outputs that hold configuration (sizes, shapes, settings), not measurements:
# logged as parameters, so that the run's metrics are what it measured
CONFIG_KEYS = frozenset({
    "architecture", "mesh", "assumptions", "max_length", "sequence_length", "beta", "completions_per_step",
    "global_batch_size", "micro_batch_size", "global_batch", "per_device_batch", "gradient_accumulation",
    "devices", "memory_gib", "lm_eval", "rewards", "trainable_params", "total_params",
})


def log_output(name: str, value) -> None:
    """Logs one node output to the active run, by type: a mapping as JSON plus its numbers as metrics
    (its configuration keys as parameters), a table as JSON lines, a text as Markdown."""
    if isinstance(value, Mapping):
        mlflow.log_dict(_jsonable(value), mlflow_name(f"{name}.json"))
        metrics, params = {}, {}
        for key, item in flatten(value).items():
            if CONFIG_KEYS.intersection(str(key).split(".")):
                if isinstance(item, (str, int, float, bool, np.number)):
                    params[mlflow_name(f"{name}.{key}")] = str(item)
            elif (number := numeric(item)) is not None:
                metrics[mlflow_name(f"{name}.{key}")] = number
        mlflow.log_metrics(metrics)
        if params:
            # MLflow refuses to change a parameter: a resumed run keeps the values it logged first
            logged = mlflow.MlflowClient().get_run(mlflow.active_run().info.run_id).data.params
            log_params({k: v for k, v in params.items() if k not in logged})
    elif isinstance(value, pd.DataFrame):
        mlflow.log_text(value.to_json(orient="records", lines=True), mlflow_name(f"{name}.jsonl"))
    elif isinstance(value, str):
        mlflow.log_text(value, mlflow_name(f"{name}.md"))


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
