"""The real Gemma 3 270M made better at GSM8K, measured fairly: the `gemma3_270m_gsm8k_cpu` recipe (LoRA SFT on the
train split, GRPO on its prompts), base / SFT / GRPO scored by our evaluation on GSM8K's whole test split, and
lm-evaluation-harness's `hf` backend through the shipped `tagged_answer` task on the folders the pipeline wrote.

    python benchmarks/gsm8k_real.py                          # the recipe, then hf on base_model/ and exported/
    python benchmarks/gsm8k_real.py --root /tmp/g --skip-run   # the table, on a finished run's folders
    python benchmarks/gsm8k_real.py --params evaluate.num_prompts=64,sft.max_steps=60   # a shorter run
    python benchmarks/gsm8k_real.py --env gemma3_270m_gsm8k_gpu --skip-hf --out benchmarks/results/gsm8k_gpu.json

1. `kedro run --env gemma3_270m_gsm8k_cpu` under `--root` (its log in root/kedro.log): the PyPI model converted to
   an fp32 folder (`06_models/base_model`), SFT, evaluation of base and SFT, GRPO, evaluation of SFT and GRPO,
   export of the final policy (`06_models/exported`, LoRA merged).
2. lm-eval's `hf` backend (transformers, float32, `--torch-threads`) on `base_model/` and `exported/` over the same
   test rows, with the same prompt (the recipe's instruction in Gemma's chat template) and generation length.
3. One table: base / base k-shot (`evaluate.few_shot`) / SFT / GRPO x strict, lenient and format, each with its
   95% interval, the paired tests (SFT against base and base k-shot, GRPO against SFT, base and base k-shot), training examples, steps and wall times, and hf's three scores beside
   ours. Prints one JSON object, writes benchmarks/results/gsm8k_real.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from tunix_pipeline.evaluate.evaluation import PAIRED_KEYS  # noqa: E402

READINGS = ("answer_accuracy", "lenient_accuracy", "format_compliance")
HF_READINGS = ("strict,none", "lenient,none", "format,none")  # tagged_answer's names for the same readings
FOLDERS = {"base": "06_models/base_model", "grpo": "06_models/exported"}  # hf runs on these (the export is GRPO's)


def run_recipe(root: Path, env_name: str, extra: str) -> dict:
    """The recipe's whole DAG under `root`, timed; its log in root/kedro.log."""
    params = f"runtime.output_root={root}" + (f",{extra}" if extra else "")
    command = [sys.executable, "-m", "kedro", "run", "--env", env_name, "--params", params]
    env = {**os.environ, "DO_NOT_TRACK": "1", "KEDRO_DISABLE_TELEMETRY": "true"}
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(root / "kedro.log", "w") as log:
        done = subprocess.run(command, cwd=common.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"kedro run failed ({done.returncode}); see {root / 'kedro.log'}")
    result = {"command": " ".join(command[2:]), "wall_seconds": seconds}
    (root / "kedro_run.json").write_text(json.dumps(result))
    return result


def run_hf(root: Path, label: str, max_gen_toks: int, threads: int) -> dict:
    """lm-eval's `hf` backend on one model's folder over the run's scored rows: tagged_answer's three scores and
    seconds (kept in root/hf_<label>.json and reused)."""
    kept = root / f"hf_{label}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from tunix_pipeline.config import HarnessParams
    from tunix_pipeline.data.formatting import answer_rows
    from tunix_pipeline.evaluate import harness
    from tunix_pipeline.generate.generation import scored_split

    metrics = json.loads((root / "08_reporting/eval_metrics.json").read_text())
    documents = metrics["base"]["prompts"]  # what our evaluation scored: the first rows of the scored split
    formatted = answer_rows(scored_split(pd.read_parquet(root / "03_primary/eval_formatted.parquet"))).head(documents)
    tokenizer = AutoTokenizer.from_pretrained(root / FOLDERS["base"])
    rows = harness.write_rows(formatted, tokenizer, root / "harness_rows.jsonl")
    torch.set_num_threads(threads)
    started = time.perf_counter()
    lm = HFLM(pretrained=str(root / FOLDERS[label]), dtype="float32", device="cpu", batch_size=32)
    params = HarnessParams(enabled=True, tasks=["tagged_answer"], max_gen_toks=max_gen_toks)
    result = harness.evaluate(lm, params, rows, samples=True)
    harness.write_samples(result["samples"], root / "07_model_output/harness_hf", label)
    out = {"scores": result["scores"]["tagged_answer"], "documents": len(formatted),
           "seconds": time.perf_counter() - started, "torch_threads": threads}
    kept.write_text(json.dumps(out))
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def table(root: Path) -> dict:
    """Our scores of base, SFT and GRPO with their intervals and paired tests, and what trained each stage."""
    first, after_grpo = _json(root / "08_reporting/eval_metrics.json"), _json(root / "08_reporting/grpo_eval_metrics.json")
    shown = [label for label in first if label.startswith("base_") and label.endswith("shot")]  # evaluate.few_shot
    scored = {"base": first.get("base"), **{label: first[label] for label in shown}, "sft": first.get("tuned"),
              "grpo": after_grpo.get("grpo")}
    sft, grpo = _json(root / "06_models/sft_result.json"), _json(root / "06_models/grpo_result.json")
    models = {}
    for label, m in scored.items():
        if not m:
            continue
        models[label] = {"problems": m["prompts"], **{k: m[k] for k in READINGS},
                         **{f"{k}_ci95": m[f"{k}_ci95"] for k in READINGS},
                         "truncated": m.get("truncated"), "mean_completion_tokens": m.get("mean_completion_tokens")}
        models[label].update({key: m[key] for key in PAIRED_KEYS if m.get(key)})
    models.setdefault("sft", {})["training"] = {
        k: sft.get(k) for k in ("latest_step", "global_batch_size", "sequence_length", "train_seconds", "last_loss")}
    if grpo:
        models.setdefault("grpo", {})["training"] = {
            k: grpo.get(k) for k in ("latest_step", "train_seconds", "completions_per_step", "reward_trend")}
    return models


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="gemma3_270m_gsm8k_cpu", help="the recipe (a conf/ environment)")
    ap.add_argument("--root", default="/tmp/gsm8k_real", help="the run's output root")
    ap.add_argument("--params", default="", help="more kedro --params, comma-separated")
    ap.add_argument("--skip-run", action="store_true", help="reuse a finished run under --root")
    ap.add_argument("--skip-hf", action="store_true", help="our scores only")
    ap.add_argument("--max-gen-toks", type=int, default=256, help="as the recipe's evaluate.max_new_tokens")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", default=str(common.RESULTS / "gsm8k_real.json"))
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()

    out: dict = {"recipe": args.env, "root": str(root), "machine_at_start": common.machine(),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True,
                                          text=True).stdout.strip()}
    out["kedro_run"] = _json(root / "kedro_run.json") if args.skip_run else run_recipe(root, args.env, args.params)
    out["data"] = {k: v for k, v in _json(root / "08_reporting/data_quality.json").get("totals", {}).items()
                   if k in ("train_rows", "dev_rows", "test_rows", "overlap_with_eval_only")}
    out["models"] = table(root)
    if not args.skip_hf:
        for label in FOLDERS:
            if label in out["models"]:
                hf = run_hf(root, label, args.max_gen_toks, args.torch_threads)
                out["models"][label]["hf"] = {ours: hf["scores"][theirs] for ours, theirs in zip(READINGS, HF_READINGS)}
                out["models"][label]["hf_run"] = {k: v for k, v in hf.items() if k != "scores"}
    out["machine_at_end"] = common.machine()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    common.emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
