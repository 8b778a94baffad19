"""Shared pieces of the benchmarks: the model folder, the batches, the machine, the matmul peak.

Every benchmark prints one JSON object on stdout (logs go to stderr).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# About 20M parameters with Gemma's shape ratios (MQA, MLP 8x wide, tied embedding,
# a vocabulary that is a fifth of the weights): 9 x 1.74M decoder + 16384 x 256 embedding.
GEMMA_20M = dict(
    vocab_size=16384, hidden_size=256, intermediate_size=2048, num_layers=9, num_heads=4, num_kv_heads=1, head_dim=64
)
# seconds, not minutes: what tests/test_benchmarks.py runs
GEMMA_TINY = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
)


def write_gemma_folder(out_dir: str | Path, spec: dict, seed: int = 0) -> Path:
    """A Hugging Face Gemma folder (config.json + model.safetensors) with random weights, offline.

    The same weights and initialisation as the tiny-model builder
    (`tunix_pipeline.models.tiny`), without a tokenizer: the benchmarks feed token ids.
    """
    from safetensors.numpy import save_file
    from transformers import GemmaConfig

    from tunix_pipeline.config import TinyModelParams
    from tunix_pipeline.models.tiny import hf_config, random_gemma_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields = hf_config(TinyModelParams(**spec), spec["vocab_size"])  # the vocabulary as given, not padded
    fields.pop("model_type")
    config = GemmaConfig(**fields, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.save_pretrained(out)
    save_file(random_gemma_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def parameter_count(spec: dict) -> int:
    d, f, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    q, kv = spec["num_heads"] * spec["head_dim"], spec["num_kv_heads"] * spec["head_dim"]
    layer = 2 * d * q + 2 * d * kv + 3 * d * f + 2 * d
    return v * d + spec["num_layers"] * layer + d


def token_rows(n: int, seq_len: int, vocab: int, seed: int = 0):
    """`n` rows in the tokenize stage's format: a prompt (no loss), a completion, then padding.

    Lengths vary (some rows full, some padded) like real SFT data; ids 0-2 are pad/eos/bos.
    """
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = seq_len if i % 2 == 0 else int(rng.integers(seq_len // 2, seq_len))
        prompt = int(rng.integers(1 + length // 16, 2 + length // 3))
        tokens = np.zeros(seq_len, np.int32)
        tokens[0] = 2
        tokens[1:length] = rng.integers(3, vocab, length - 1)
        loss = np.zeros(seq_len, np.int32)
        loss[prompt:length] = 1
        seg = np.zeros(seq_len, np.int32)
        seg[:length] = 1
        pos = np.zeros(seq_len, np.int32)
        pos[:length] = np.arange(length)
        rows.append({"id": str(i), "input_tokens": tokens, "loss_mask": loss, "segment_ids": seg, "positions": pos})
    return pd.DataFrame(rows)


def useful_throughput(useful: list[int], median_seconds: float, slots_per_step: int) -> dict:
    """The timed steps counting their non-padding tokens only (`useful`, each step's): their mean over the median
    step time (as `tokens_per_s` counts every slot), and the share of padding in them."""
    return {
        "useful_tokens_per_s": float(np.mean(useful)) / median_seconds,
        "padding_fraction": 1 - sum(useful) / (len(useful) * slots_per_step),
    }


def matmul_peak_gflops(n: int = 2048, seconds: float = 3.0, dtype: str = "float32") -> dict:
    """The machine's matmul rate in `dtype`: a large jitted `jnp.dot`, best of repeated runs."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    flops = 2.0 * n**3
    return {
        "matmul_peak_gflops": flops / min(times) / 1e9,
        "matmul_median_gflops": flops / float(np.median(times)) / 1e9,
        "matmul_size": n,
        "matmul_runs": len(times),
    }


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far: Linux's VmHWM, which starts afresh at exec (`ru_maxrss`
    keeps the parent's peak across fork and exec, so every worker would report its driver's); KiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(mem_gb, 1) if mem_gb else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
    }


def describe(m: dict) -> str:
    return f"{m['cpu']}, {m['usable_cores']} cores, {m['memory_gb']} GiB, {m['platform']}"


def run_json(args: list[str], timeout: float, env: dict | None = None) -> dict:
    """Runs a benchmark script in a fresh process; its last stdout line is the JSON result."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    wall = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:], "wall_seconds": wall}
    out = json.loads(lines[-1])
    out.setdefault("wall_seconds", wall)
    return out


def emit(result: dict, out: str | None = None) -> None:
    """Prints the result as one JSON line; also writes it, indented, to `out` when given."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=float))
    print(json.dumps(result, default=float), flush=True)


class CompileTimer:
    """Seconds JAX spent tracing, lowering and compiling, in all and per function name, and how often."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        import jax

        self.seconds = 0.0
        self.compiles = 0
        self.by_fun: dict[str, dict] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def ensure_listening(self) -> None:
        """Re-registers after `jax.monitoring.clear_event_listeners()` (Tunix's MetricsLogger.close calls it)."""
        from jax._src import monitoring

        if self._on not in monitoring.get_event_duration_listeners():
            monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, fun_name: str = "", **kwargs) -> None:
        if event not in self.EVENTS:
            return
        self.seconds += duration
        entry = self.by_fun.setdefault(str(fun_name), {"seconds": 0.0, "compiles": 0})
        entry["seconds"] += duration
        if event.endswith("backend_compile_duration"):
            self.compiles += 1
            entry["compiles"] += 1

    def snapshot(self) -> tuple[float, int]:
        return self.seconds, self.compiles

    def matching(self, *names: str) -> dict:
        """Seconds and compiles of the functions whose name contains any of `names` (e.g. the train step)."""
        hits = {k: v for k, v in self.by_fun.items() if any(n in k for n in names)}
        return {
            "seconds": sum(v["seconds"] for v in hits.values()),
            "compiles": sum(v["compiles"] for v in hits.values()),
            "functions": sorted(hits),
        }
