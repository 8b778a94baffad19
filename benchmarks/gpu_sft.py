"""SFT step on a GPU: a Gemma-2B-shaped model (random weights, bf16), ours vs Tunix's default trainer.

    python benchmarks/gpu_sft.py                  # skipped (one JSON line saying so) without a GPU
    python benchmarks/gpu_sft.py --batch 8 --seq 1024

Gemma-2B's shape (18 layers, 2048 wide, MLP 16384, 8 heads of 256 with one KV
head, 256128-token vocabulary), random weights, bf16 weights and compute, AdamW,
one GPU (mesh auto). Reports tokens/s, step time, compile time, device memory
and MFU against the card's dense bf16 peak (a table of known cards, and a
measured large bf16 `jnp.dot`), for `ours` (`train.sft.train` as the sft node
runs it), `tunix_default` (Tunix's PeftTrainer with its one-hot loss) and
`torch` (transformers' Gemma in PyTorch, sdpa attention, fused AdamW), each in
its own process; MFU counts the same FLOPs per step for all three. Beside each
rate, the same steps counting their non-padding tokens only
(`useful_tokens_per_s`, `useful_mfu`) and their share of padding
(`padding_fraction`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

# dense bf16 tensor-core peaks, FLOP/s (the planner's profiles use the same figures)
BF16_PEAK = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "T4": 65e12,
}
GEMMA_2B = dict(
    vocab_size=256128, hidden_size=2048, intermediate_size=16384, num_layers=18, num_heads=8, num_kv_heads=1, head_dim=256
)


def gpu_devices():
    try:
        import jax

        return jax.devices("gpu")
    except Exception:  # noqa: BLE001 - no CUDA/ROCm backend: no GPU
        return []


def table_peak(kind: str) -> float | None:
    for name, peak in BF16_PEAK.items():  # most specific names first
        if name.lower() in kind.lower():
            return peak
    return None


def measured_peak(seconds: float = 2.0, n: int = 8192) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.bfloat16)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    dot(a, a).block_until_ready()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def make_model(spec: dict, dtype: str):
    """A Tunix Gemma of `spec`'s shape with random weights in `dtype`."""
    import jax
    from flax import nnx
    from tunix.models.gemma import model as gemma_lib

    cfg = gemma_lib.ModelConfig(
        num_layers=spec["num_layers"],
        num_embed=spec["vocab_size"],
        embed_dim=spec["hidden_size"],
        hidden_dim=spec["intermediate_size"],
        num_heads=spec["num_heads"],
        head_dim=spec["head_dim"],
        num_kv_heads=spec["num_kv_heads"],
        final_logit_softcap=None,
        use_post_attn_norm=False,
        use_post_ffw_norm=False,
        attention_types=(gemma_lib.AttentionType.GLOBAL,) * spec["num_layers"],
    )

    @nnx.jit
    def create():
        model = gemma_lib.Gemma(cfg, rngs=nnx.Rngs(0))
        leaves, treedef = jax.tree.flatten(nnx.state(model))
        key = jax.random.PRNGKey(0)
        # every matrix random (Tunix initialises the MLP to zeros), norms as they are; then `dtype`
        leaves = [
            (jax.random.normal(jax.random.fold_in(key, i), x.shape) * 0.02 if x.ndim >= 2 else x).astype(dtype)
            for i, x in enumerate(leaves)
        ]
        nnx.update(model, jax.tree.unflatten(treedef, leaves))
        # laid out on the mesh as a loaded checkpoint is (else the step compiles again once sharded)
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    return create()


def worker(args) -> dict:
    import jax
    import numpy as np
    from tunix.sft import metrics_logger, peft_trainer

    from benchmarks.cpu_sft import _logged_useful_tokens, _Recorder, _series, _sft_params, tunix_model_input_fn
    from tunix_pipeline.config import RuntimeParams
    from tunix_pipeline.models.architecture import model_flops_per_token
    from tunix_pipeline.core import progress, runtime
    from tunix_pipeline.train import loop
    from tunix_pipeline.train.loop import make_optimizer
    from tunix_pipeline.train.sft import train

    spec = GEMMA_2B if args.size == "2b" else common.GEMMA_TINY
    _Recorder.events = []
    timer = common.CompileTimer()
    device = jax.devices()[0]
    mesh = runtime.make_mesh(RuntimeParams(mesh="auto"), devices=[device])
    with tempfile.TemporaryDirectory() as tmp:
        sft = _sft_params(args, str(Path(tmp) / "ckpt"))
        with mesh:
            model = make_model(spec, args.dtype)
        rows = common.token_rows(args.batch * 4, args.seq, spec["vocab_size"], seed=0)
        flops = args.batch * args.seq * model_flops_per_token(model, args.seq)
        t0 = time.perf_counter()
        if args.worker == "ours":
            train(model, rows, rows.iloc[:0], sft, mesh, metrics_backends=[_Recorder])
        else:
            feed = loop.BatchFeed(rows, args.batch, sft.seed)
            batches = [
                {"input_tokens": b["input_tokens"], "input_mask": b["loss_mask"]}
                for b in (feed.batch(i) for i in range(sft.max_steps))
            ]
            config = peft_trainer.TrainingConfig(eval_every_n_steps=sft.max_steps + 1, max_steps=sft.max_steps)
            options = metrics_logger.MetricsLoggerOptions(
                log_dir=str(Path(tmp) / "logs"), backend_kwargs={"custom_backend": [_Recorder]}
            )
            with mesh:
                trainer = peft_trainer.PeftTrainer(
                    model, make_optimizer(sft, sft.max_steps), config, metrics_logger=metrics_logger.MetricsLogger(options)
                )
                trainer.with_gen_model_input_fn(tunix_model_input_fn())
                trainer.with_training_hooks(
                    progress.throughput_hooks(feed.step_tokens, flops / (args.batch * args.seq), None, 1)
                )
                trainer.train(batches)
        wall = time.perf_counter() - t0
    steps = _series("step_time")[args.warmup :][: args.steps]  # from the second step on
    useful = _logged_useful_tokens(rows, args, sft.seed)[args.warmup :][: args.steps]
    median = float(np.median(steps))
    stats = device.memory_stats() or {}
    step = timer.matching("train_step")
    return {
        "step_seconds_median": median,
        "steps_timed": len(steps),
        "tokens_per_s": args.batch * args.seq / median,  # every slot, padding included
        **common.useful_throughput(useful, median, args.batch * args.seq),
        "tflops_per_s": flops / median / 1e12,
        "flops_per_step": flops,
        "compile_seconds": step["seconds"],
        "train_step_compiles": step["compiles"],
        "peak_device_memory_gb": stats.get("peak_bytes_in_use", 0) / 1e9 or None,
        "train_wall_seconds": wall,
        "first_loss": _series("loss")[0] if _series("loss") else None,
        "last_loss": _series("loss")[-1] if _series("loss") else None,
    }


def worker_torch(args) -> dict:
    """The same model, batch and optimizer in PyTorch: transformers' Gemma (sdpa attention), bf16, fused AdamW."""
    import numpy as np
    import torch
    from transformers import GemmaConfig, GemmaForCausalLM

    spec = GEMMA_2B if args.size == "2b" else common.GEMMA_TINY
    config = GemmaConfig(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"], num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only under --force-cpu
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = GemmaForCausalLM(config).to(device=device, dtype=getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=device == "cuda")
    rows = common.token_rows(args.batch * 4, args.seq, spec["vocab_size"], seed=0)
    tokens = np.stack(rows["input_tokens"].to_numpy())
    real = (np.stack(rows["segment_ids"].to_numpy()) > 0).sum(axis=1)  # non-padding tokens of each row
    times, losses, useful = [], [], []
    for step in range(args.warmup + args.steps):
        batch = slice((step % 4) * args.batch, (step % 4 + 1) * args.batch)
        useful.append(int(real[batch].sum()))
        ids = torch.from_numpy(tokens[batch].astype(np.int64)).to(device)
        sync()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # syncs
        times.append(time.perf_counter() - t)
    median = float(np.median(times[args.warmup :]))
    return {
        "step_seconds_median": median,
        "steps_timed": args.steps,
        "tokens_per_s": args.batch * args.seq / median,  # every slot, padding included
        **common.useful_throughput(useful[args.warmup :], median, args.batch * args.seq),
        "peak_device_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "torch_version": torch.__version__,
    }


def run(args) -> dict:
    base = {"benchmark": "gpu_sft", "machine": common.describe(common.machine())}
    devices = gpu_devices()
    if not devices and not args.force_cpu:
        return {**base, "skipped": "no GPU"}
    import jax

    device = devices[0] if devices else jax.devices()[0]
    kind = device.device_kind
    out = {
        **base,
        "device": kind,
        "model": {**(GEMMA_2B if args.size == "2b" else common.GEMMA_TINY), "dtype": args.dtype},
        "batch": args.batch,
        "seq_len": args.seq,
        "bf16_peak_flops_table": table_peak(kind),
    }
    out["bf16_peak_flops_measured"] = measured_peak(seconds=1.0, n=8192 if devices else 512)
    peak = out["bf16_peak_flops_table"] or out["bf16_peak_flops_measured"]
    for name in ("ours", "tunix_default", "torch"):
        cmd = [
            str(Path(__file__).resolve()), "--worker", name, "--size", args.size, "--dtype", args.dtype,
            "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
        ]
        out[name] = common.run_json(cmd, timeout=args.timeout, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    flops = next((out[n]["flops_per_step"] for n in ("ours", "tunix_default") if "flops_per_step" in out[n]), None)
    for name in ("ours", "tunix_default", "torch"):
        if flops and out[name].get("step_seconds_median"):  # the same FLOPs per step for all three
            out[name]["mfu"] = flops / out[name]["step_seconds_median"] / peak
            out[name]["useful_mfu"] = flops / (args.batch * args.seq) * out[name]["useful_tokens_per_s"] / peak
    ours, tunix, torch = (out[n].get("tokens_per_s") for n in ("ours", "tunix_default", "torch"))
    out["ours_tokens_per_s"], out["tunix_default_tokens_per_s"], out["torch_tokens_per_s"] = ours, tunix, torch
    out["ours_mfu"] = out["ours"].get("mfu")
    for key in ("useful_tokens_per_s", "useful_mfu", "padding_fraction"):  # non-padding tokens only
        out[f"ours_{key}"] = out["ours"].get(key)
    out["ours_vs_tunix_default"] = ours / tunix if ours and tunix else None
    out["ours_vs_torch"] = ours / torch if ours and torch else None
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=["2b", "tiny"], default="2b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--force-cpu", action="store_true", help="run on the CPU anyway (to test the script: --size tiny)")
    p.add_argument("--out")
    p.add_argument("--worker", choices=["ours", "tunix_default", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    result = (worker_torch(args) if args.worker == "torch" else worker(args)) if args.worker else run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
