"""The real Gemma 3 270M fine-tuned on GSM8K and scored by lm-evaluation-harness's own `gsm8k` task, by our JAX
backend inside the pipeline and by lm-eval's `hf` backend on the folders the pipeline wrote.

    python benchmarks/gsm8k_real.py                         # ~1 h on a 2-core CPU
    python benchmarks/gsm8k_real.py --root /tmp/g --hf-only base   # hf on base_model/ once it exists (in parallel)
    python benchmarks/gsm8k_real.py --root /tmp/g --skip-run  # the report, on a finished run's folders

1. `kedro run --env gemma3_270m_gsm8k_cpu` under `--root`: the PyPI model converted to an fp32 folder
   (`06_models/base_model`), LoRA SFT on the shipped GSM8K train rows, our evaluation (eval loss, format
   compliance) and lm-eval's gsm8k on base and tuned through our backend (each document's generation in
   `07_model_output/harness/`), export (`06_models/exported`, LoRA merged).
2. lm-eval's `hf` backend (transformers, float32) on `base_model/` and `exported/` with the recipe's harness
   settings: the same task, documents, few-shot seed and generation length. torch runs on `--torch-threads`
   (1 by default: on a shared, oversubscribed CPU torch's OpenMP threads wait on each other; RESULTS.md,
   section 9). A model's hf result is kept in `hf_<model>.json` and reused.
3. Both backends' strict-match and flexible-extract side by side, how many generations are identical, our eval
   loss and format compliance, and wall times. Prints one JSON object, writes benchmarks/results/gsm8k_real.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

ENV = "gemma3_270m_gsm8k_cpu"
KEDRO = str(Path(sys.executable).parent / "kedro")
SCORES = ("exact_match,strict-match", "exact_match,flexible-extract")
FOLDERS = {"base": "06_models/base_model", "tuned": "06_models/exported"}  # under the output root


def harness_params():
    """The recipe's `evaluate.harness` (conf/base merged with the recipe), without its samples folder."""
    from tunix_pipeline.config import HarnessParams

    base = yaml.safe_load((common.ROOT / "conf/base/parameters_evaluate.yml").read_text())["evaluate"]["harness"]
    recipe = yaml.safe_load((common.ROOT / f"conf/{ENV}/parameters.yml").read_text())["evaluate"]["harness"]
    return HarnessParams(**{**base, **recipe, "samples_dir": None})


def run_recipe(root: Path, extra: str) -> dict:
    """The recipe's whole DAG under `root`, timed; its log in root/kedro.log."""
    params = f"runtime.output_root={root}" + (f",{extra}" if extra else "")
    command = [KEDRO, "run", "--env", ENV, "--params", params]
    env = {**os.environ, "DO_NOT_TRACK": "1", "KEDRO_DISABLE_TELEMETRY": "true"}
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(root / "kedro.log", "w") as log:
        done = subprocess.run(command, cwd=common.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"kedro run failed ({done.returncode}); see {root / 'kedro.log'}")
    result = {"command": " ".join(command[1:]), "wall_seconds": seconds}
    (root / "kedro_run.json").write_text(json.dumps(result))
    return result


def run_hf(root: Path, label: str, params, threads: int) -> dict:
    """lm-eval's `hf` backend on one model's folder: scores and seconds (kept in root/hf_<label>.json), each
    document's generation in root/07_model_output/harness_hf/<label>_gsm8k.jsonl."""
    kept = root / f"hf_{label}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    import torch
    from lm_eval.models.huggingface import HFLM

    from tunix_pipeline import harness

    torch.set_num_threads(threads)
    started = time.perf_counter()
    lm = HFLM(pretrained=str(root / FOLDERS[label]), dtype="float32", device="cpu", batch_size=params.batch_size)
    result = harness.evaluate(lm, params, None, samples=True)
    harness.write_samples(result["samples"], root / "07_model_output/harness_hf", label)
    out = {"scores": result["scores"]["gsm8k"], "seconds": time.perf_counter() - started, "torch_threads": threads,
           "peak_rss_mb": common.peak_rss_mb(), "load_average_at_end": os.getloadavg()}
    kept.write_text(json.dumps(out))
    return out


def _generations(path: Path) -> dict[int, str]:
    rows = [json.loads(line) for line in path.open()]
    return {r["doc_id"]: r["resps"][0][0] for r in rows if r["filter"] == "strict-match"}


def compare(ours: Path, theirs: Path) -> dict:
    """How many documents got the same generation from both backends, and which did not."""
    a, b = _generations(ours), _generations(theirs)
    differ = sorted(i for i in a if a[i] != b.get(i))
    return {"documents": len(a), "identical": len(a) - len(differ), "differ": differ}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/gsm8k_real", help="the run's output root")
    ap.add_argument("--params", default="", help="more kedro --params, comma-separated")
    ap.add_argument("--skip-run", action="store_true", help="reuse a finished run under --root")
    ap.add_argument("--hf-only", choices=sorted(FOLDERS), help="only lm-eval's hf backend on this model, then stop")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", default=str(common.RESULTS / "gsm8k_real.json"))
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    if args.hf_only:
        return run_hf(root, args.hf_only, harness_params(), args.torch_threads)

    out: dict = {"recipe": ENV, "root": str(root), "machine_at_start": common.machine(),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True,
                                          text=True).stdout.strip()}
    out["kedro_run"] = json.loads((root / "kedro_run.json").read_text()) if args.skip_run else run_recipe(root, args.params)
    metrics = json.loads((root / "08_reporting/eval_metrics.json").read_text())
    sft = json.loads((root / "06_models/sft_result.json").read_text()) if (root / "06_models/sft_result.json").is_file() else {}
    out["settings"] = metrics["harness"]["lm_eval"]
    out["sft"] = {k: sft.get(k) for k in ("latest_step", "first_loss", "last_loss", "train_seconds", "sequence_length", "global_batch_size")}

    params = harness_params()
    out["models"] = {}
    for label in FOLDERS:
        hf = run_hf(root, label, params, args.torch_threads)
        ours = metrics["harness"][label]["gsm8k"]
        out["models"][label] = {
            "ours": {k: ours[k] for k in SCORES},
            "hf": {k: hf["scores"][k] for k in SCORES},
            "hf_run": {k: v for k, v in hf.items() if k != "scores"},
            "generations": compare(root / "07_model_output/harness" / f"{label}_gsm8k.jsonl",
                                   root / "07_model_output/harness_hf" / f"{label}_gsm8k.jsonl"),
            "ours_eval": {k: metrics[label].get(k) for k in ("eval_loss", "format_compliance", "answer_accuracy")},
        }
    out["machine_at_end"] = common.machine()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    common.emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
