"""SFT step throughput on this CPU: our step vs Tunix's default trainer vs PyTorch, against the matmul peak.

    python benchmarks/cpu_sft.py                 # the 20M Gemma, batch 8 x 256, fp32 (a few minutes)
    python benchmarks/cpu_sft.py --size tiny --steps 2 --warmup 1    # seconds: a smoke test of the script

One real CPU device (no fake mesh). The same Hugging Face Gemma folder (random
weights written by our tiny-model builder's code) and the same batches feed:

- `ours`: `tunix_pipeline.train.sft.train` as the sft node calls it: our loss,
  optimizer, data feed, hooks and trainer (checkpointing only at the end);
- `tunix_default`: Tunix's `PeftTrainer` with its default (one-hot) loss and the
  input function of Tunix's SFT examples, same optimizer;
- `torch`: transformers' `GemmaForCausalLM` on the CPU, AdamW, same clipping,
  learning-rate schedule and weight-decay mask;
- `matmul`: the largest rate of a big jitted `jnp.dot` (the machine's peak).

Throughput is reported twice: every token slot of the fixed-length rows
(`tokens_per_s`, `gflops_per_s`, MFU) and the non-padding ones only
(`useful_tokens_per_s`, `useful_gflops_per_s`, useful MFU), with the padding
share of the timed steps (`padding_fraction`); the rows are half full, half
padded to a random length, so the two differ.

Each runs in its own process (clean peak memory, its own compile); the step time
is the median of `--steps` steps after the first (compiling) step and `--warmup`
more. `--extra` adds ablations: ours without our XLA:CPU compile options, and
Tunix's default trainer with them; `--bf16` adds ours with bf16 compute and
PyTorch with bf16 autocast. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

SIZES = {"20m": common.GEMMA_20M, "tiny": common.GEMMA_TINY}


def _rows(args):
    spec = SIZES[args.size]
    # four batches' worth: every contender draws its batches with the pipeline's seeded shuffle (BatchFeed)
    return common.token_rows(args.batch * 4, args.seq, spec["vocab_size"], seed=0)


def _sft_params(args, checkpoint_dir: str):
    """The smoke run's SFT settings (conf/base with conf/gpu_smoke: the tiny model's) at this benchmark's batch and
    length."""
    import yaml

    from tunix_pipeline.config import SftParams

    base = yaml.safe_load((common.ROOT / "conf" / "base" / "parameters_sft.yml").read_text())["sft"]
    base.update(yaml.safe_load((common.ROOT / "conf" / "gpu_smoke" / "parameters.yml").read_text())["sft"])
    total = 1 + args.warmup + args.steps + 1  # the compile step, warm-up, timed steps, one spare
    base.update(
        max_steps=total,
        per_device_batch_size=args.batch,
        warmup_steps=min(base.get("warmup_steps", 0), total - 1),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=10**6,  # only the final save, after the timed steps
        eval_every=None,
        time_budget_hours=None,
    )
    if getattr(args, "compute_dtype", None):
        base["compute_dtype"] = args.compute_dtype
    return SftParams(**base)


class _Recorder:
    """A Tunix metrics backend that keeps every scalar (step time, loss) in memory."""

    events: list = []

    def log_scalar(self, event, value, **kwargs):
        import numpy as np

        _Recorder.events.append((event.strip("/"), float(np.asarray(value)), kwargs.get("step")))

    def close(self):
        pass


def _one_device_mesh():
    """The pipeline's mesh (`runtime.mesh: auto`) over one device: the first one JAX has."""
    import jax

    from tunix_pipeline.config import RuntimeParams
    from tunix_pipeline.core import runtime

    return runtime.make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])


def _series(name: str) -> list[float]:
    return [v for e, v, _ in _Recorder.events if e == f"train/{name}"]


def _logged_useful_tokens(rows, args, seed: int) -> list[int]:
    """Non-padding tokens of each step the throughput hook timed (the steps it logged `step_time` at), counted
    from the batches the pipeline's feed gives those steps."""
    from tunix_pipeline.train import loop

    feed = loop.BatchFeed(rows, args.batch, seed)
    return [feed.step_tokens(step)[1] for e, _, step in _Recorder.events if e == "train/step_time"]


def _summary(step_times: list[float], useful_tokens: list[int], args, flops_per_step: float, timer=None,
             extra=None) -> dict:
    """`step_times` and the `useful_tokens` (non-padding) of those steps start after the first (compiling) step."""
    import numpy as np

    timed = step_times[args.warmup :][: args.steps]
    useful = useful_tokens[args.warmup :][: args.steps]
    step = timer.matching("train_step") if timer else None
    median = float(np.median(timed))
    goodput = common.useful_throughput(useful, median, args.batch * args.seq)
    return {
        "step_seconds_median": median,
        "step_seconds_min": float(np.min(timed)),
        "step_seconds_max": float(np.max(timed)),
        "steps_timed": len(timed),
        "tokens_per_s": args.batch * args.seq / median,  # every slot, padding included
        **goodput,
        "gflops_per_s": flops_per_step / median / 1e9,
        "useful_gflops_per_s": flops_per_step / (args.batch * args.seq) * goodput["useful_tokens_per_s"] / 1e9,
        "flops_per_step": flops_per_step,
        # tracing + lowering + XLA compile of the train step, and how many times it compiled (1 is right)
        "compile_seconds": step["seconds"] if timer else None,
        "train_step_compiles": step["compiles"] if timer else None,
        "all_jax_compile_seconds": timer.seconds if timer else None,
        "peak_rss_mb": common.peak_rss_mb(),
        **(extra or {}),
    }


# ---------------------------------------------------------------- workers (one process each)
def worker_ours(args) -> dict:
    """Our sft step through `train.sft.train`, as the sft node configures it (one device: mesh auto)."""
    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import load_run_model
    from tunix_pipeline.models.architecture import model_flops_per_token
    from tunix_pipeline.core import runtime
    from tunix_pipeline.train.sft import train

    if args.no_cpu_options:
        runtime.CPU_COMPILER_OPTIONS = {}
    _Recorder.events = []
    timer = common.CompileTimer()
    with tempfile.TemporaryDirectory() as tmp:
        sft = _sft_params(args, str(Path(tmp) / "ckpt"))
        mesh = _one_device_mesh()
        model, _ = load_run_model(args.model, ModelParams(source=args.model, dtype="float32"), mesh, remat=sft.remat)
        rows = _rows(args)
        flops = args.batch * args.seq * model_flops_per_token(model, args.seq)
        loaded_rss = common.peak_rss_mb()
        t0 = time.perf_counter()
        result = train(model, rows, rows.iloc[:0], sft, mesh, metrics_backends=[_Recorder])
        wall = time.perf_counter() - t0
    # step_time is logged from the second step on (the first one compiles)
    steps = _series("step_time")
    loss = _series("loss")
    return _summary(
        steps,
        _logged_useful_tokens(rows, args, sft.seed),
        args,
        flops,
        timer,
        {
            "train_wall_seconds": wall,
            "first_loss": result["first_loss"],
            "last_loss": result["last_loss"],
            "losses": loss,
            "rss_after_load_mb": loaded_rss,
            "cpu_compiler_options": runtime.step_compiler_options(),
        },
    )


def tunix_model_input_fn(pad_id: int = 0):
    """The input function of Tunix's SFT examples: positions and a causal mask from the padding."""
    from tunix.sft import utils as sft_utils

    def gen_model_input_fn(x):
        pad_mask = x["input_tokens"] != pad_id
        return {
            "input_tokens": x["input_tokens"],
            "input_mask": x["input_mask"],
            "positions": sft_utils.build_positions_from_mask(pad_mask),
            "attention_mask": sft_utils.make_causal_attn_mask(pad_mask),
        }

    return gen_model_input_fn


def worker_tunix_default(args) -> dict:
    """Tunix's PeftTrainer out of the box: its default loss (one-hot), same model, optimizer and batches."""
    from tunix.sft import metrics_logger, peft_trainer

    from tunix_pipeline import upstream
    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import load_run_model
    from tunix_pipeline.models.architecture import model_flops_per_token
    from tunix_pipeline.core import progress
    from tunix_pipeline.train import loop
    from tunix_pipeline.train.loop import make_optimizer

    _Recorder.events = []
    timer = common.CompileTimer()
    with tempfile.TemporaryDirectory() as tmp:
        sft = _sft_params(args, str(Path(tmp) / "ckpt"))
        mesh = _one_device_mesh()
        model, _ = load_run_model(args.model, ModelParams(source=args.model, dtype="float32"), mesh)
        rows = _rows(args)
        feed = loop.BatchFeed(rows, args.batch, sft.seed)
        batches = [
            {"input_tokens": b["input_tokens"], "input_mask": b["loss_mask"]}
            for b in (feed.batch(i) for i in range(sft.max_steps))
        ]
        flops = args.batch * args.seq * model_flops_per_token(model, args.seq)
        config = peft_trainer.TrainingConfig(eval_every_n_steps=sft.max_steps + 1, max_steps=sft.max_steps)
        options = metrics_logger.MetricsLoggerOptions(
            log_dir=str(Path(tmp) / "logs"), backend_kwargs={"custom_backend": [_Recorder]}
        )
        with mesh:
            if args.with_cpu_options:  # ablation: Tunix's trainer with our compile options
                trainer = upstream.trainer_class()(
                    model, make_optimizer(sft, sft.max_steps), config, metrics_logger=metrics_logger.MetricsLogger(options)
                )
            else:
                trainer = peft_trainer.PeftTrainer(
                    model, make_optimizer(sft, sft.max_steps), config, metrics_logger=metrics_logger.MetricsLogger(options)
                )
            trainer.with_gen_model_input_fn(tunix_model_input_fn())
            # the same step-time hook as ours, so both are measured the same way (batch i is the feed's step i + 1)
            trainer.with_training_hooks(
                progress.throughput_hooks(feed.step_tokens, flops / (args.batch * args.seq), None, 1)
            )
            t0 = time.perf_counter()
            trainer.train(batches)
            wall = time.perf_counter() - t0
    return _summary(
        _series("step_time"),
        _logged_useful_tokens(rows, args, sft.seed),
        args,
        flops,
        timer,
        {
            "train_wall_seconds": wall,
            "first_loss": _series("loss")[0],
            "last_loss": _series("loss")[-1],
            "losses": _series("loss"),
        },
    )


def worker_torch(args) -> dict:
    """transformers' Gemma in PyTorch on the CPU: the same folder, batches, AdamW and gradient clipping."""
    import numpy as np
    import torch
    from transformers import GemmaForCausalLM

    from tunix_pipeline.train import loop
    from tunix_pipeline.train.loop import learning_rate_schedule

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        sft = _sft_params(args, str(Path(tmp) / "ckpt"))
    model = GemmaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": sft.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=sft.learning_rate,
    )
    # the pipeline's warm-up and decay, step by step (optax's schedule, evaluated on the host)
    schedule = learning_rate_schedule(sft, sft.max_steps)
    lr_at = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: float(schedule(s)) / sft.learning_rate)
    feed = loop.BatchFeed(_rows(args), args.batch, sft.seed)
    params = sum(p.numel() for p in model.parameters())
    spec = SIZES[args.size]
    flops = args.batch * args.seq * (
        6.0 * params + 12.0 * spec["num_layers"] * spec["num_heads"] * spec["head_dim"] * args.seq
    )
    loaded_rss = common.peak_rss_mb()
    times, losses, useful = [], [], []
    for step in range(1 + args.warmup + args.steps):
        b = feed.batch(step)
        useful.append(int((b["segment_ids"] > 0).sum()))
        ids = torch.from_numpy(b["input_tokens"].astype(np.int64))
        mask = torch.from_numpy((b["segment_ids"] > 0).astype(np.int64))
        labels = ids.masked_fill(torch.from_numpy(b["loss_mask"] == 0), -100)
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.compute_dtype == "bfloat16"):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if sft.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), sft.max_grad_norm)
        optimizer.step()
        lr_at.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    return _summary(
        times[1:],
        useful[1:],
        args,
        flops,
        None,
        {
            "first_step_seconds": times[0],
            "autocast": args.compute_dtype,
            "torch_version": torch.__version__,
            "torch_threads": threads,
            "attn_implementation": model.config._attn_implementation,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "losses": losses,
            "parameters": params,
            "rss_after_load_mb": loaded_rss,
        },
    )


def worker_matmul(args) -> dict:
    best = {}
    for n in (1024, 2048):
        r = common.matmul_peak_gflops(n, seconds=args.matmul_seconds)
        if r["matmul_peak_gflops"] > best.get("matmul_peak_gflops", 0):
            best = r
    return best


WORKERS = {
    "ours": worker_ours,
    "tunix_default": worker_tunix_default,
    "torch": worker_torch,
    "matmul": worker_matmul,
}


# ---------------------------------------------------------------- driver
def run(args) -> dict:
    spec = SIZES[args.size]
    machine = common.machine()
    out = {
        "benchmark": "cpu_sft",
        "machine": common.describe(machine),
        "machine_detail": machine,
        "model": {**spec, "parameters": common.parameter_count(spec), "dtype": "float32"},
        "batch": args.batch,
        "seq_len": args.seq,
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "devices": "1 CPU device (no fake mesh)",
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = common.write_gemma_folder(Path(tmp) / "gemma", spec, seed=0)
        plan = ["matmul", "ours", "tunix_default", "torch"]
        if args.extra:
            plan += ["ours_no_cpu_options", "tunix_default_with_cpu_options"]
        if args.bf16:
            plan += ["ours_bf16_compute", "torch_bf16_autocast"]
        if args.only:
            plan = [p for p in plan if p in args.only.split(",")]
        for name in plan:
            worker, flags = name, []
            if name == "ours_no_cpu_options":
                worker, flags = "ours", ["--no-cpu-options"]
            if name == "tunix_default_with_cpu_options":
                worker, flags = "tunix_default", ["--with-cpu-options"]
            if name == "ours_bf16_compute":
                worker, flags = "ours", ["--compute-dtype", "bfloat16"]
            if name == "torch_bf16_autocast":
                worker, flags = "torch", ["--compute-dtype", "bfloat16"]
            print(f"cpu_sft: {name} ...", file=sys.stderr, flush=True)
            cmd = [
                str(Path(__file__).resolve()), "--worker", worker, "--model", str(folder), "--size", args.size,
                "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--matmul-seconds", str(args.matmul_seconds), *flags,
            ]
            # one real device: never the fake mesh the tests and smoke use
            env = {"XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                         if "xla_force_host_platform_device_count" not in f)}
            out[name] = common.run_json(cmd, timeout=args.timeout, env=env)
            print(f"cpu_sft: {name}: {json.dumps(out[name], default=float)[:300]}", file=sys.stderr, flush=True)
    out.update(_ratios(out))
    return out


def _ratios(out: dict) -> dict:
    def get(name, key):
        return (out.get(name) or {}).get(key)

    peak = get("matmul", "matmul_peak_gflops")
    ours, tunix, torch = (get(n, "tokens_per_s") for n in ("ours", "tunix_default", "torch"))
    r = {
        "ours_tokens_per_s": ours,
        "tunix_default_tokens_per_s": tunix,
        "torch_tokens_per_s": torch,
        "matmul_peak_gflops": peak,
        "ours_mfu": get("ours", "gflops_per_s") / peak if peak and get("ours", "gflops_per_s") else None,
        "tunix_default_mfu": get("tunix_default", "gflops_per_s") / peak if peak and tunix else None,
        "torch_mfu": get("torch", "gflops_per_s") / peak if peak and torch else None,
        "ours_vs_tunix_default": ours / tunix if ours and tunix else None,
        "ours_vs_torch": ours / torch if ours and torch else None,
    }
    for name in ("ours", "tunix_default", "torch"):  # the same steps counting their non-padding tokens only
        if get(name, "useful_tokens_per_s"):
            r[f"{name}_useful_tokens_per_s"] = get(name, "useful_tokens_per_s")
            r[f"{name}_useful_mfu"] = get(name, "useful_gflops_per_s") / peak if peak else None
            r[f"{name}_padding_fraction"] = get(name, "padding_fraction")
    for name in ("ours_no_cpu_options", "tunix_default_with_cpu_options", "ours_bf16_compute", "torch_bf16_autocast"):
        if get(name, "tokens_per_s"):
            r[f"{name}_tokens_per_s"] = get(name, "tokens_per_s")
            r[f"{name}_mfu"] = get(name, "gflops_per_s") / peak if peak else None
    r["targets"] = {
        "ours_mfu >= 0.60": bool(r["ours_mfu"] and r["ours_mfu"] >= 0.60),
        "ours_vs_tunix_default >= 1.3": bool(r["ours_vs_tunix_default"] and r["ours_vs_tunix_default"] >= 1.3),
        "ours_vs_torch >= 2": bool(r["ours_vs_torch"] and r["ours_vs_torch"] >= 2.0),
    }
    return r


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="20m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="steps after the first (compiling) step that are not timed")
    p.add_argument("--matmul-seconds", type=float, default=3.0)
    p.add_argument("--extra", action="store_true", help="also run the ablations")
    p.add_argument("--bf16", action="store_true", help="also run ours with bf16 compute and torch with bf16 autocast")
    p.add_argument("--only", help="comma-separated subset of contenders")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--no-cpu-options", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--with-cpu-options", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compute-dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](args)
    else:
        result = run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
