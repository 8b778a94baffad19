"""The base model at its best: shown `evaluate.few_shot` solved training examples, scored on the recipe's whole test
split through the evaluation's own path, alone (the evaluation node scores the base zero-shot and the tuned model
in the same call; this is the base's k-shot part by itself, for a session that cannot also train).

    python benchmarks/base_few_shot.py                           # gemma3_270m_gsm8k_cpu, all 1,319 test problems
    python benchmarks/base_few_shot.py --params evaluate.num_prompts=64

1. `kedro run --env ENV --to-nodes format_eval,format_eval_few_shot` under `--root` (the PyPI model converted to
   `06_models/base_model`, the eval split formatted zero-shot and k-shot).
2. The recipe's settings read by Kedro (`--params` over them); the base loaded as the evaluation node loads it (the
   recipe's LoRA adapters, still zero) and scored by `Evaluator.on_prompts(eval_few_shot).measure`: the same prompts,
   generation, stop rules and readings as `evaluate_models`' `base_<k>shot`. Its rows are kept in
   `evaluate.generations_dir` under the base policy's digest, so an interrupted run, and the evaluation node itself
   on the same root, take them rather than generating them again.
3. Prints one JSON object (writes `--out`): strict, lenient and format with their 95% Wilson intervals, the ids of the
   problems each reading got right (what a later paired test against a tuned model needs), tokens and minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402



def recipe_params(env: str, settings: str) -> dict:
    """The recipe's parameters as the pipeline's nodes get them: validated, `settings` (kedro's `--params` text)
    applied as kedro run applies them."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from omegaconf import OmegaConf

    from tunix_pipeline.run.hooks import context_params

    bootstrap_project(common.ROOT)
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist(settings.split(",")))
    with KedroSession.create(project_path=common.ROOT, env=env, runtime_params=overrides) as session:
        return context_params(session.load_context())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="gemma3_270m_gsm8k_cpu", help="the recipe (a conf/ environment)")
    ap.add_argument("--root", default="/tmp/gsm8k_real", help="the run's output root")
    ap.add_argument("--params", default="", help="more settings, comma-separated key=value (as kedro --params)")
    ap.add_argument("--out", default=str(common.RESULTS / "base_few_shot.json"))
    args = ap.parse_args()

    settings = ",".join([*filter(None, args.params.split(",")), f"runtime.output_root={args.root}"])
    kedro = str(Path(sys.executable).parent / "kedro")
    subprocess.run([kedro, "run", "--env", args.env, "--to-nodes", "format_eval,format_eval_few_shot",
                    "--params", settings], cwd=common.ROOT, check=True)

    import jax

    from tunix_pipeline.config import EvaluateParams, ModelParams, RuntimeParams
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.data.formatting import few_shot_label
    from tunix_pipeline.evaluate.evaluation import READINGS, Evaluator
    from tunix_pipeline.evaluate.policies import scored_by
    from tunix_pipeline.models import load_run_model, load_tokenizer

    recipe = recipe_params(args.env, settings)
    params, model, runtime = (EvaluateParams(**recipe["evaluate"]), ModelParams(**recipe["model"]),
                              RuntimeParams(**recipe["runtime"]))
    if not params.few_shot:
        raise SystemExit(f"{args.env} sets no evaluate.few_shot: nothing to score")
    root = Path(args.root)
    base_model = {"path": str(root / "06_models" / "base_model")}
    eval_formatted = pd.read_parquet(root / "03_primary" / "eval_formatted.parquet")
    eval_few_shot = pd.read_parquet(root / "03_primary" / "eval_few_shot.parquet")

    mesh = make_mesh(runtime)
    network, _ = load_run_model(base_model["path"], model, mesh, quantize=False)  # as `evaluate_models` loads it
    tokenizer = load_tokenizer(base_model["path"])
    zero_shot = Evaluator(network, tokenizer, mesh, params, pd.DataFrame(), eval_formatted, 1,
                          decode_weights=runtime.decode_weights)
    label = few_shot_label("base", params.few_shot)
    started = time.perf_counter()
    metrics, rows = zero_shot.on_prompts(eval_few_shot).measure(
        label, scored_by(base_model, None, None, model, params, runtime))
    minutes = (time.perf_counter() - started) / 60

    out = {
        "benchmark": "base_few_shot", "env": args.env, "label": label, "few_shot": params.few_shot,
        "settings": settings, "metrics": metrics, "minutes": round(minutes, 1),
        "right": {name: sorted(rows.loc[rows[column].fillna(False).astype(bool), "id"].astype(str))
                  for name, column in READINGS.items()},
        "devices": jax.device_count(), "machine": common.machine(),
    }
    common.emit(out, args.out)


if __name__ == "__main__":
    main()
