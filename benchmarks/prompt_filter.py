"""`grpo.prompt_filter` on the real model: the `gemma3_270m_gsm8k_cpu` recipe's SFT policy (its latest checkpoint
under `--root`, a folder the recipe has run in) samples `--samples` completions for each of the first `--n` prompts
of the recipe's GRPO pool, as the rollouts sample, scored by the `answer` reward: how many prompts the filter keeps,
how many it finds never or always right, what share of the recipe's 4-sample groups hold a right and a wrong
answer before and after it, and the screen's seconds.

    python benchmarks/prompt_filter.py --root /tmp/gsm8k_recipe --n 32 --samples 8

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

RECIPE = "gemma3_270m_gsm8k_cpu"


def mixed_share(right: list[int], samples: int, group: int) -> float:
    """The expected share of `group`-sample groups holding a right and a wrong answer, each prompt right with its
    observed rate `right / samples` (groups drawn without replacement from its samples)."""
    from math import comb

    def both(r: int) -> float:
        return 1 - (comb(r, group) + comb(samples - r, group)) / comb(samples, group)

    return sum(both(r) for r in right) / len(right)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the recipe's runtime.output_root, SFT run in it")
    parser.add_argument("--n", type=int, default=32, help="pool prompts screened")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from tunix_pipeline.config import GrpoParams
    from tunix_pipeline.core.paths import storage_path
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.models import load_run_model, load_tokenizer
    from tunix_pipeline.train import grpo
    from tunix_pipeline.train.checkpoints import restore_latest

    bootstrap_project(common.ROOT)
    with KedroSession.create(project_path=common.ROOT, env=RECIPE,
                             runtime_params={"runtime": {"output_root": str(args.root)}}) as session:
        context = session.load_context()
        params, catalog = context.params, context.catalog
        train, base = catalog.load("train_formatted"), catalog.load("base_model")
    runtime, model = params["runtime"], params["model"]  # parsed by the project's config loader
    screen_dir = Path(tempfile.mkdtemp(prefix="prompt_filter_"))
    settings = GrpoParams(**{**params["grpo"].model_dump(), "checkpoint_dir": str(screen_dir), "prompt_filter": {
        "samples": args.samples, "reward": "answer", "batch_size": args.batch_size}})
    mesh = make_mesh(runtime)
    tokenizer = load_tokenizer(base["path"])
    network, _ = load_run_model(base["path"], model, mesh)
    sft = Path(params["sft"].checkpoint_dir)
    step = restore_latest(network, storage_path(str(sft)))
    inputs = grpo.prepare(train, tokenizer, settings, mesh)
    pool = inputs.prompts.head(args.n).reset_index(drop=True)
    started = time.perf_counter()
    try:
        kept, summary = grpo.filtered_prompts(network, tokenizer, pool, inputs.rewards, settings, mesh,
                                              storage_path(str(screen_dir)), runtime.decode_weights)
    except grpo.NothingToLearn as err:  # fewer kept than a batch: the counts are still in the file
        kept, summary = None, {"skipped": err.reason}
    seconds = time.perf_counter() - started
    scores = json.loads((screen_dir / grpo.FILTER_FILE).read_text())["scores"]
    right = [sum(s > 0.999 for s in row) for row in scores.values()]
    group = settings.num_generations
    out = {
        "recipe": RECIPE, "sft_checkpoint": str(sft / str(step)), "sft_step": step, "prompts": len(pool),
        "samples": args.samples, "max_completion_length": settings.max_completion_length,
        "temperature": settings.temperature, **summary,
        "right_per_prompt": {str(k): right.count(k) for k in range(args.samples + 1)},
        "sample_accuracy": sum(right) / (len(right) * args.samples),
        f"mixed_{group}_sample_groups_before": mixed_share(right, args.samples, group),
        f"mixed_{group}_sample_groups_kept": mixed_share([r for r in right if 0 < r < args.samples] or [0],
                                                        args.samples, group),
        "seconds": seconds, "completions_per_second": len(pool) * args.samples / seconds,
        "kept_prompts": None if kept is None else len(kept), "machine": common.machine(),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
