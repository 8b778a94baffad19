"""The sampler's decode step with XLA:CPU's default fusion against the train step's dot fusion, which the sampler now
compiles with (`core.runtime.CPU_COMPILER_OPTIONS`; `docs/upstream_tunix.md`, "Tunix's jitted steps take no compiler
options"), on the real Gemma 3 270M in float32.

    python benchmarks/decode_fusion.py                    # batch 32, 1,024-token prompts: the 3-shot prompts' cache
    python benchmarks/decode_fusion.py --prompt-length 256 --rows 0

1. Continuous batching's decode loop (`Sampler._decode_rows`) for `--batch` rows in a cache of prompt length +
   2 x `--new-tokens` positions, compiled both ways in one process: the copies of a layer's KV cache XLA runs each
   step (the loop body's `copy` ops of the cache's shape), the seconds a step over `--steps` steps, and whether the
   two loops chose the same tokens.
2. With `--rows N` (default 32): the `gemma3_270m_gsm8k_cpu` recipe's base scored on its `base_3shot` prompts (made
   by the recipe's own nodes, as `benchmarks/eval_resume.py` does) for the first N test problems, once each way:
   the whole evaluation's seconds, the decode loop's share, and whether every row's tokens and the scores are equal.

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402


def decode_loop(sampler, batch: int, prompt: int, new: int):
    """(the jitted decode loop, its arguments as continuous batching first passes them) for `batch` prompts."""
    decode, taken = sampler._decode_rows, {}

    def take(*args, **kwargs):
        taken.update(args=args, kwargs=kwargs)
        raise StopIteration

    sampler._decode_rows = take
    ids = [[2] + list(range(1000, 1000 + prompt - 60 + i)) for i in range(batch)]  # distinct prompts, near the limit
    try:
        sampler.generate_rows(ids, batch_size=batch, max_prompt_length=prompt, max_generation_steps=new,
                              eos_tokens=[-1], refill=batch // 4)
    except StopIteration:
        pass
    return decode, taken["args"], taken["kwargs"]


@contextlib.contextmanager
def sampler_options(fused: bool):
    """Within: samplers built with the dot fusion (as shipped) or, `fused=False`, with XLA:CPU's defaults."""
    from tunix_pipeline.upstream import generation

    options = generation.step_compiler_options
    if not fused:
        generation.step_compiler_options = dict
    try:
        yield
    finally:
        generation.step_compiler_options = options


def loop_figures(model, tokenizer, fused: bool, batch: int, prompt: int, new: int, steps: int) -> dict:
    """The decode loop (the cache sized for `new` tokens, each row ending after `steps`): the cache copies a step, the
    seconds a step, the tokens chosen."""
    import jax
    import numpy as np

    from tunix_pipeline.generate.generation import make_sampler

    with sampler_options(fused):
        sampler = make_sampler(model, tokenizer, prompt + 2 * new)
        decode, args, kwargs = decode_loop(sampler, batch, prompt, new)
        compiled = decode.lower(*args, **{**kwargs, "max_new": steps}).compile()
    hlo = compiled.as_text()
    body = re.search(r"body=%([\w.\-]+)", hlo).group(1)
    start = hlo.index(f"%{body} ")
    cache = next(x for x in jax.tree.leaves(args[1].state.cache) if x.ndim == 4)
    shape = r"\[" + ",".join(map(str, cache.shape)) + r"\]"
    copies = len(re.findall(rf"= f32{shape}\S* copy\(", hlo[start : hlo.index("\n}", start)]))
    first = int(args[1].state.decoding_step)
    started = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))  # the loop's state is donated: one run
    seconds = time.perf_counter() - started
    ran = int(out.state.decoding_step) - first
    return {"cache_copies_per_step": copies, "cache_shape": list(cache.shape), "steps": ran,
            "seconds_per_step": round(seconds / max(ran, 1), 4),
            "tokens": np.asarray(out.state.token_buffer[:, first : first + ran + 1])}


def recipe_rows(root: Path, rows: int, fused: bool) -> dict:
    """The recipe's base on its 3-shot prompts (`eval_resume.score`), its sampler compiled with the dot fusion or,
    `fused=False`, with XLA:CPU's defaults; the decode loop's and the prefill's seconds (compiles included) apart."""
    import jax

    from benchmarks.eval_resume import score
    from tunix_pipeline.upstream import generation

    spent = {"decode": 0.0, "prefill": 0.0}
    init = generation.Sampler.__init__

    def timer(name, fn):
        def timed(*a, **k):
            started = time.perf_counter()
            out = jax.block_until_ready(fn(*a, **k))
            spent[name] += time.perf_counter() - started
            return out
        return timed

    def timed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._decode_rows = timer("decode", self._decode_rows)
        self._prefills = {g: timer("prefill", f) for g, f in self._prefills.items()}

    generation.Sampler.__init__ = timed_init
    kept = root / "decode_fusion" / ("fused" if fused else "default")
    shutil.rmtree(kept, ignore_errors=True)
    try:
        with sampler_options(fused):
            result = score(root, rows, kept, "rows")
    finally:
        generation.Sampler.__init__ = init
    return {"seconds": round(result["seconds"], 1), **{f"{k}_seconds": round(v, 1) for k, v in spent.items()},
            "rows": result["rows"], "metrics": result["metrics"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=1024, help="the padded prompt length (3-shot: 1,024)")
    parser.add_argument("--new-tokens", type=int, default=256, help="sizes the cache: prompt + 2 x this")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed each way")
    parser.add_argument("--rows", type=int, default=32, help="3-shot test problems scored each way (0: none)")
    parser.add_argument("--root", default="/tmp/eval_resume", help="output root of the recipe's first nodes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(args.root)

    import numpy as np

    from benchmarks.eval_resume import recipe
    from tunix_pipeline.core.runtime import step_compiler_options
    from tunix_pipeline.models import load_pretrained

    recipe(root, run=True)  # the recipe's first nodes: the PyPI model converted once, the 3-shot prompts
    out = {"benchmark": "decode_fusion", "machine": common.machine(), "load_at_start": os.getloadavg()[0],
           "options": step_compiler_options(), "batch": args.batch, "prompt_length": args.prompt_length,
           "new_tokens": args.new_tokens}
    model, tokenizer = load_pretrained(root / "06_models" / "base_model")
    loops = {name: loop_figures(model, tokenizer, name == "fused", args.batch, args.prompt_length, args.new_tokens,
                                args.steps) for name in ("default", "fused")}
    out["loop"] = {name: {k: v for k, v in figures.items() if k != "tokens"} for name, figures in loops.items()}
    out["loop"]["same_tokens"] = bool(np.array_equal(loops["default"]["tokens"], loops["fused"]["tokens"]))
    out["loop"]["speedup"] = round(loops["default"]["seconds_per_step"] / loops["fused"]["seconds_per_step"], 2)
    if args.rows:
        runs = {name: recipe_rows(root, args.rows, fused=name == "fused") for name in ("default", "fused")}
        scores = ("answer_accuracy", "lenient_accuracy", "format_compliance")
        out["recipe_rows"] = {
            "problems": args.rows,
            **{name: {**{k: v for k, v in r.items() if k.endswith("seconds")}, **{k: r["metrics"][k] for k in scores}}
               for name, r in runs.items()},
            "rows_equal": f"{sum(a == b for a, b in zip(runs['default']['rows'], runs['fused']['rows']))} of {args.rows}",
        }
    common.emit(out, args.out)


if __name__ == "__main__":
    main()
