"""The memory estimate against XLA:TPU's compiled train step, on this CPU (libtpu, no TPU): JSON lines.

    python benchmarks/tpu_memory.py                 # Gemma-2B on a v5e-8: batch 1/2/4 x 512/1024, remat or not
    python benchmarks/tpu_memory.py --layers 2      # the same grid two layers deep
    python benchmarks/tpu_memory.py --recipes       # the TPU recipes' own steps (tpu_full, qwen05b_v5e8, v4_64_pod,
                                                    # the Kaggle LoRA recipes; --only NAME for one)
    python benchmarks/tpu_memory.py --recipes --whole --only kaggle_gemma2_2b_v5e8   # every layer compiled

Each line: the setup, XLA:TPU's peak bytes per chip, the estimate for the same step, their
difference, and the compile time. The grid compiles Gemma-2B `--layers` deep (default 1) and
estimates that very model; the recipes are compiled at two depths and extrapolated to theirs, as
the plan does (`xla.xla_peak`), or with `--whole` at every layer (minutes each). `tests/test_tpu_compile.py` and `tests/test_recipes.py`
hold the estimate to 10% of these. A grid compile takes ~15-40 s of a quiet CPU (one layer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tunix_pipeline.config import LoraParams, ModelParams, TinyModelParams  # noqa: E402
from tunix_pipeline.planning import TrainSetup, estimate_memory, from_hf_config, resolve, xla  # noqa: E402
from tunix_pipeline.planning.memory import GIB  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cases(recipes: bool, layers: int):
    known = yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"]["architectures"]
    gemma = from_hf_config(known["google/gemma-2b"], "google/gemma-2b")
    if not recipes:
        for remat in ("none", "decoder"):
            for length in (512, 1024):
                for batch in (1, 2, 4):
                    setup = TrainSetup(per_device_batch=batch, seq_len=length, fsdp=8, param_dtype="bfloat16", remat=remat)
                    yield f"gemma-2b, {layers} layer(s)", gemma.with_layers(layers), setup, "v5e:2x4", 1, None
        return
    # the recipes' steps as their plans set them up (conf/<recipe>/parameters.yml)
    yield "tpu_full", gemma, TrainSetup(per_device_batch=4, seq_len=1024, fsdp=8, param_dtype="bfloat16",
                                        remat="decoder"), "v5e:2x4", 1, None
    # what the memory the chunked loss freed would buy it: float32 master weights under bf16 compute
    yield "tpu_full_f32_masters", gemma, TrainSetup(per_device_batch=4, seq_len=1024, fsdp=8, param_dtype="float32",
                                                    compute_dtype="bfloat16", remat="decoder"), "v5e:2x4", 1, None
    qwen = from_hf_config(known["Qwen/Qwen2.5-0.5B"], "Qwen/Qwen2.5-0.5B")
    yield "qwen05b_v5e8", qwen, TrainSetup(per_device_batch=4, seq_len=1000, fsdp=8, compute_dtype="bfloat16",
                                           remat="decoder", grad_accum=2), "v5e:2x4", 1, None
    pod = resolve(ModelParams(tiny=TinyModelParams(hidden_size=512, intermediate_size=1536, num_heads=8,
                                                   num_kv_heads=8, head_dim=64)))
    yield ("v4_64_pod", pod, TrainSetup(per_device_batch=192, seq_len=97, fsdp=32, compute_dtype="bfloat16"),
           "v4:4x4x2", 8, None)
    # the Kaggle recipes' LoRA SFT steps (conf/<recipe>/parameters.yml)
    for env in ("kaggle_gemma3_1b_v5e8", "kaggle_gemma2_2b_v5e8"):
        recipe = yaml.safe_load((ROOT / "conf" / env / "parameters.yml").read_text())
        source, sft, lora = recipe["model"]["source"], recipe["sft"], LoraParams(**recipe["model"]["lora"])
        arch = from_hf_config({**known, **recipe["plan"]["architectures"]}[source], source)
        yield env, arch, TrainSetup(
            per_device_batch=sft["per_device_batch_size"], seq_len=recipe["tokenize"]["max_length"], fsdp=8,
            param_dtype="bfloat16", mode="lora", lora_rank=lora.rank, grad_accum=sft.get("gradient_accumulation_steps", 1),
            remat=sft.get("remat", "none")), "v5e:2x4", 1, lora

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", action="store_true")
    parser.add_argument("--layers", type=int, default=1, help="the grid's depth (compiled whole, no extrapolation)")
    parser.add_argument("--only", help="one recipe's step (with --recipes)")
    parser.add_argument("--whole", action="store_true", help="compile every layer instead of extrapolating")
    args = parser.parse_args()
    steps = list(cases(args.recipes, args.layers))
    if args.only and args.only not in {name for name, *_ in steps}:
        parser.error(f"--only {args.only}: not one of the recipes' steps ({', '.join(name for name, *_ in steps)})")
    for name, arch, setup, topology, hosts, lora in steps:
        if args.only and name != args.only:
            continue
        started = time.perf_counter()
        got = xla.xla_peak(arch, setup, None if args.whole else 4, lora, xla.tpu_devices(topology, hosts))
        est = estimate_memory(arch, setup.replace(backend="tpu")).peak
        print(json.dumps({
            "model": name, "topology": topology, "per_device_batch": setup.per_device_batch, "seq_len": setup.seq_len,
            "remat": setup.remat, "loss_chunk": setup.loss_chunk, "xla_tpu_gib": round(got["peak"] / GIB, 3),
            "estimate_gib": round(est / GIB, 3), "difference": round((est - got["peak"]) / got["peak"], 4),
            "xla_tflops_per_chip": round(got["flops"] / 1e12, 3), "method": got["method"],
            "seconds": round(time.perf_counter() - started, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
