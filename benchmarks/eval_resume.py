"""An evaluation killed part-way and run again, on the real model: the `gemma3_270m_gsm8k_cpu` recipe's base shown
its 3 solved train problems (`base_3shot`'s prompts, made by the recipe's own ingest and format nodes), scored on
the first `--n` GSM8K test problems once whole, and once in a child process killed (SIGKILL) once `--kill-at` rows
are written to `evaluate.generations_dir`, then run again on what it kept.

    python benchmarks/eval_resume.py                         # 64 problems, killed after 32 rows
    python benchmarks/eval_resume.py --n 1319 --kill-at 600 --skip-whole   # the whole split in two parts

Prints one JSON object: rows written at the kill, rows the rerun took and generated, each part's seconds, and how
many of the rerun's rows (tokens and texts) and scores equal the whole run's. `--out` also writes it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

RECIPE = "gemma3_270m_gsm8k_cpu"


def recipe(root: Path, run: bool = False):
    """(the k-shot eval rows, the base model's entry, model, evaluate and runtime settings) of the recipe under
    `root`; `run`: its ingest, base model and format nodes run first (the PyPI model converted once there)."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(common.ROOT)
    with KedroSession.create(project_path=common.ROOT, env=RECIPE,
                             runtime_params={"runtime": {"output_root": str(root)}}) as session:
        if run:
            session.run(to_nodes=["format_eval_few_shot"])
            return None
        context = session.load_context()
        params = context.params
        return (context.catalog.load("eval_few_shot"), context.catalog.load("base_model"), params["model"],
                params["evaluate"], params["runtime"])


def score(root: Path, n: int, kept: Path, label: str) -> dict:
    """The base on the k-shot prompts through `Evaluator.measure`, its rows kept in `kept`: metrics, rows, seconds."""
    import pandas as pd

    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.data.formatting import few_shot_label
    from tunix_pipeline.evaluate.evaluation import Evaluator
    from tunix_pipeline.models import load_run_model, load_tokenizer

    rows, base, model, evaluate, runtime = recipe(root)
    evaluate = evaluate.model_copy(update={"num_prompts": n, "generations_dir": str(kept)})
    mesh = make_mesh(runtime)
    network, _ = load_run_model(base["path"], model, mesh, quantize=False)
    evaluator = Evaluator(network, load_tokenizer(base["path"]), mesh, evaluate, pd.DataFrame(), rows, 1)
    started = time.perf_counter()
    metrics, samples = evaluator.measure(few_shot_label("base", evaluate.few_shot), label)
    return {"metrics": metrics, "seconds": time.perf_counter() - started,
            "rows": samples[["id", "generated", "completion_tokens"]].to_dict(orient="records")}


def lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def killed_part_way(root: Path, n: int, kept: Path, kill_at: int, timeout: float) -> dict:
    """This script's `--child` scoring into `kept`, killed with SIGKILL once `kill_at` rows are written there."""
    command = [sys.executable, __file__, "--child", "--root", str(root), "--n", str(n), "--kept", str(kept)]
    started = time.perf_counter()
    with open(kept.parent / "child.log", "w") as log:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        while lines(kept / "resume.jsonl") < kill_at and child.poll() is None:
            if time.perf_counter() - started > timeout:
                break
            time.sleep(1)
        finished = child.poll() is not None
        child.send_signal(signal.SIGKILL)
        child.wait()
    return {"seconds_to_kill": round(time.perf_counter() - started, 1), "rows_written": lines(kept / "resume.jsonl"),
            "finished_before_kill": finished}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64, help="test problems (the first n of the scored split)")
    parser.add_argument("--kill-at", type=int, default=None, help="rows written when the child is killed (n / 2)")
    parser.add_argument("--root", default="/tmp/eval_resume", help="output root of the recipe's first nodes")
    parser.add_argument("--skip-whole", action="store_true", help="no uninterrupted run to compare with")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds the child may run before the kill")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kept", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(args.root)
    if args.child:
        score(root, args.n, Path(args.kept), "resume")
        return

    recipe(root, run=True)  # the recipe's first nodes, once, before anything is timed
    out = {"benchmark": "eval_resume", "recipe": RECIPE, "problems": args.n, "machine": common.machine(),
           "load_at_start": os.getloadavg()[0]}
    kept = root / "eval_resume" / "stopped"
    for stale in (kept / "resume.jsonl", root / "eval_resume" / "whole" / "whole.jsonl"):
        stale.unlink(missing_ok=True)
    kept.mkdir(parents=True, exist_ok=True)
    out["killed"] = killed_part_way(root, args.n, kept, args.kill_at or args.n // 2, args.timeout)
    rerun = score(root, args.n, kept, "resume")
    out["rerun"] = {"seconds": round(rerun["seconds"], 1), "rows_taken": rerun["metrics"].get("generations_resumed", 0),
                    "lenient_accuracy": rerun["metrics"]["lenient_accuracy"],
                    "format_compliance": rerun["metrics"]["format_compliance"]}
    if not args.skip_whole:
        whole = score(root, args.n, root / "eval_resume" / "whole", "whole")
        same = [a == b for a, b in zip(whole["rows"], rerun["rows"])]
        scores = ("answer_accuracy", "lenient_accuracy", "format_compliance")
        out["whole"] = {"seconds": round(whole["seconds"], 1), **{k: whole["metrics"][k] for k in scores}}
        out["rows_equal"] = f"{sum(same)} of {len(same)}"
        out["scores_equal"] = all(whole["metrics"][k] == rerun["metrics"][k] for k in scores)
    common.emit(out, args.out)


if __name__ == "__main__":
    main()
