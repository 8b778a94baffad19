"""GRPO's two programs against the estimate, compiled by XLA:TPU on this CPU (libtpu, no TPU): JSON lines.

    python benchmarks/grpo_tpu.py                           # tpu_full and both Kaggle recipes, as `plan` compiles them
    python benchmarks/grpo_tpu.py --layers 2,3,4            # each at these depths: the data to refit the estimate

For each recipe (its GRPO session's parameters, its v5e 2x4 topology and mesh) and phase (one decode step
with the KV cache, with the recipe's `runtime.decode_weights`, or at `--layers` both sharded and gathered;
the policy update), a line with XLA:TPU's peak bytes per chip, the estimate of the same
program (`planning.grpo_xla.estimates`), their difference, the FLOPs per chip and the compile time. Each
update compile takes minutes of one core (the 256k-word logits of 8 sequences of 480 tokens).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_pipeline.config import (  # noqa: E402
    GrpoParams, LoraParams, ModelParams, PlanParams, RuntimeParams, SftParams, TokenizeParams,
)
from tunix_pipeline.planning import build_plan, grpo_xla, xla  # noqa: E402
from tunix_pipeline.planning.grpo import rollout_setup, update_setup  # noqa: E402
from tunix_pipeline.planning.memory import GIB  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("tpu_full", "kaggle_gemma3_1b_v5e8", "kaggle_gemma2_2b_v5e8")


def recipe_plan(env: str, layers: int | None = None):
    """(plan, model, grpo, runtime) of the recipe's GRPO session, optionally cut to `layers` layers."""
    base = yaml.safe_load((ROOT / "conf/base/parameters_plan.yml").read_text())["plan"]
    recipe = yaml.safe_load((ROOT / "conf" / env / "parameters.yml").read_text())
    source = recipe["model"]["source"]
    hf = dict({**base["architectures"], **recipe["plan"].get("architectures", {})}[source])
    if layers:
        hf["num_hidden_layers"] = layers
    profiles = {**base["profiles"]}
    for name, changes in recipe["plan"].get("profiles", {}).items():
        profiles[name] = {**profiles[name], **changes}
    plan = PlanParams(**{**base, "hardware": recipe["plan"]["hardware"], "profiles": profiles,
                         "architectures": {source: hf}, "train_rows": recipe["plan"].get("train_rows")})
    # the model as the GRPO session loads it: tpu_full's third session loads its float32 weights in bf16
    session = next((s["params"] for s in (recipe.get("sessions") or {}).get("plan", [])
                    if ((s.get("params") or {}).get("grpo") or {}).get("enabled")), {})
    section = {**recipe["model"], **session.get("model", {})}
    lora = LoraParams(**section["lora"]) if "lora" in section else None
    model = ModelParams(source=source, dtype=section.get("dtype", ModelParams.model_fields["dtype"].default), lora=lora)
    grpo = GrpoParams(**{**yaml.safe_load((ROOT / "conf/base/parameters_grpo.yml").read_text())["grpo"],
                         **recipe["grpo"], **session.get("grpo", {}), "enabled": True})
    sft = SftParams(**recipe["sft"])
    runtime = RuntimeParams(**recipe.get("runtime", {}))
    return build_plan(model, sft, runtime, TokenizeParams(**recipe["tokenize"]), plan), model, grpo, runtime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="", help="comma-separated depths to compile at (default: as the plan does)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    unknown = [env for env in args.recipes.split(",") if not (ROOT / "conf" / env / "parameters.yml").exists()]
    if unknown:
        parser.error(f"--recipes: no conf/<env>/parameters.yml for {', '.join(unknown)}")
    for env in args.recipes.split(","):
        if not args.layers:
            plan, model, grpo, runtime = recipe_plan(env)
            result = grpo_xla.check(plan, model, grpo, decode_weights=runtime.decode_weights)
            for phase in ("generation", "update"):
                print(json.dumps({"recipe": env, "phase": phase, "decode_weights": runtime.decode_weights,
                                  **result[phase]}), flush=True)
            continue
        for layers in (int(x) for x in args.layers.split(",")):
            plan, model, grpo, _ = recipe_plan(env, layers)
            _, devices = xla.tpu_target(plan.selected.hw)
            setup = update_setup(plan.selected, grpo)
            estimate = grpo_xla.estimates(plan.job.arch, setup, rollout_setup(plan.selected, grpo))
            for phase, weights in (("generation", "sharded"), ("generation", "gathered"), ("update", None)):
                compile_fn = (grpo_xla.compile_update_step if phase == "update" else
                              functools.partial(grpo_xla.compile_decode_step, gathered=weights == "gathered"))
                r = compile_fn(plan.job.arch, setup, grpo, layers, model.lora, devices)
                print(json.dumps({"recipe": env, "phase": phase, "decode_weights": weights, "layers": layers,
                                  "xla_gib": r["peak"] / GIB, "estimate_gib": estimate[phase] / GIB,
                                  "difference": (estimate[phase] - r["peak"]) / r["peak"],
                                  "flops_per_device": r["flops"], "bytes_accessed_per_device": r["bytes_accessed"],
                                  "seconds": r["seconds"]}), flush=True)


if __name__ == "__main__":
    main()
