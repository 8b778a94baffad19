"""The command line of this run: as typed, or, for a run started from Python (a notebook), its `kedro run`
equivalent. The output root's lock, the MLflow run and a stopped run's message name it."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping

import click


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def kedro_command(run_params: Mapping) -> str:
    """The command line of this run as typed; for a run started from Python (a notebook), its `kedro run` equivalent."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        depth, parent = 0, ctx.parent
        while parent is not None:  # `kedro run`: sys.argv holds the subcommand "run" after the program
            depth, parent = depth + 1, parent.parent
        return " ".join([ctx.command_path, shlex.join(sys.argv[1 + depth :])]).strip()
    words = ["kedro", "run"]
    if run_params.get("env"):
        words.append(f"--env={run_params['env']}")
    names = run_params.get("pipeline_names") or [run_params.get("pipeline_name")]
    if any(names):
        words.append(f"--pipelines={','.join(n for n in names if n)}")
    for key in ("from_nodes", "to_nodes", "node_names", "tags", "from_inputs", "to_outputs", "namespaces"):
        if run_params.get(key):
            words.append(f"--{key.replace('_', '-')}={','.join(run_params[key])}")
    if run_params.get("only_missing_outputs"):
        words.append("--only-missing-outputs")
    if run_params.get("extra_params"):
        words.append("--params=" + ",".join(f"{k}={v}" for k, v in flatten(run_params["extra_params"]).items()))
    return shlex.join(words)
