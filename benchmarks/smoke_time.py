"""Smoke pipeline wall time, per stage, with JAX compile time apart from the rest.

    python benchmarks/smoke_time.py
    python benchmarks/smoke_time.py --params "{tracking: {register_model: {enabled: false}}}"   # overrides, YAML

Runs `kedro run --pipelines=smoke` (a Kedro session, in a fresh process, in a
temporary copy of the project: config, raw data, metadata) with one extra
hook that times every node and the JAX tracing/compiling inside it. Reports
the process's whole wall time (start-up and imports included, as a user waits
for `kedro run`), the time before the first node, and per node: wall, compile
and the rest. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from kedro.framework.hooks import hook_impl  # noqa: E402

STAGES = {  # node name prefix -> the stage it belongs to, for the summary (first match wins)
    "ingest": "ingest",
    "prepare_base_model": "base_model",
    "format": "format",
    "tokenize": "tokenize",
    "check_sft_fits": "plan check",
    "plan": "plan",
    "train_sft": "sft",
    "evaluate_after_grpo": "evaluate after grpo",
    "evaluate_after_preference": "evaluate after preference",
    "evaluate": "evaluate",
    "build_preference_pairs": "preference pairs",
    "run_preference": "preference",
    "run_grpo": "grpo",
    "export": "export",
    "check_smoke": "smoke checks",
}


def copy_project(dest: Path) -> Path:
    """What `kedro run` needs of the project (as tests/conftest.py copies it); the package itself is installed."""
    shutil.copytree(common.ROOT / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    (dest / "conf" / "local").mkdir()
    shutil.copytree(common.ROOT / "data" / "01_raw", dest / "data" / "01_raw")
    for name in ("pyproject.toml", ".telemetry"):
        if (common.ROOT / name).exists():
            shutil.copy(common.ROOT / name, dest / name)
    (dest / "src").mkdir()
    return dest


class NodeTimer:
    """Kedro hooks: wall and JAX compile seconds of every node."""

    def __init__(self):
        self.timer = common.CompileTimer()
        self.nodes: list[dict] = []
        self.pipeline_start = None
        self.pipeline_seconds = None
        self._open: dict[str, tuple[float, float]] = {}

    @hook_impl
    def before_pipeline_run(self):
        self.pipeline_start = time.perf_counter()

    @hook_impl
    def before_node_run(self, node):
        self.timer.ensure_listening()
        self._open[node.name] = (time.perf_counter(), self.timer.seconds)

    @hook_impl
    def after_node_run(self, node):
        start, compiled = self._open.pop(node.name)
        wall = time.perf_counter() - start
        compile_s = self.timer.seconds - compiled
        self.nodes.append(
            {
                "node": node.name,
                "stage": next((s for p, s in STAGES.items() if node.name.startswith(p)), node.name),
                "seconds": wall,
                "compile_seconds": compile_s,
                "run_seconds": wall - compile_s,
                "started_at": start - STARTED,
            }
        )

    @hook_impl
    def after_pipeline_run(self):
        self.pipeline_seconds = time.perf_counter() - self.pipeline_start


def worker(project: Path, params: dict | None = None) -> dict:
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(project)
    timer = NodeTimer()
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session._hook_manager.register(timer, name="benchmark_node_timer")
        session_ready = time.perf_counter() - STARTED
        session.run(pipeline_names=["smoke"])
    stages: dict[str, dict] = {}
    for n in timer.nodes:
        s = stages.setdefault(n["stage"], {"seconds": 0.0, "compile_seconds": 0.0, "run_seconds": 0.0})
        for k in s:
            s[k] += n[k]
    first = min((n["started_at"] for n in timer.nodes), default=None)
    preference = json.loads((project / "data" / "06_models" / "preference_result.json").read_text())
    return {
        # the preference stage's held-out pair accuracy (ties half): the SFT model, then after its steps
        "preference": {k: preference.get(k) for k in (
            "method", "latest_step", "train_pairs", "eval_pairs", "heldout_pair_accuracy_before", "heldout_pair_accuracy")},
        "process_seconds": time.perf_counter() - STARTED,
        "startup_seconds": first,  # imports, session, config, hooks (MLflow run) before the first node
        "session_created_seconds": session_ready,
        "pipeline_seconds": timer.pipeline_seconds,
        "nodes_seconds": sum(n["seconds"] for n in timer.nodes),
        "compile_seconds": sum(n["compile_seconds"] for n in timer.nodes),
        "stages": stages,
        "nodes": timer.nodes,
    }


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp) / "project")
        env = {"DO_NOT_TRACK": "1", "KEDRO_DISABLE_TELEMETRY": "true"}
        environ = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "XLA_FLAGS")}
        t = time.perf_counter()
        import subprocess

        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(project), "--params", args.params or "{}"],
            cwd=project,
            env={**environ, **env},
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        wall = time.perf_counter() - t
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stderr[-6000:])
            result = {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
        else:
            result = json.loads(lines[-1])
    result.update(
        {
            "benchmark": "smoke",
            "machine": common.describe(common.machine()),
            "command": "kedro run --pipelines=smoke (a KedroSession in a fresh process, temporary project copy)",
            "params": yaml.safe_load(args.params or "{}"),
            "smoke_seconds": wall,
        }
    )
    result["targets"] = {"smoke_seconds < 120": wall < 120 and "error" not in result}
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out")
    p.add_argument("--params", help="parameter overrides as YAML, e.g. \"{sft: {max_steps: 100}}\"")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    result = worker(Path(args.worker), yaml.safe_load(args.params or "{}") or None) if args.worker else run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
