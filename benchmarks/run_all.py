"""Every benchmark in one run (`make bench`): writes benchmarks/results/latest.json and prints it.

    python benchmarks/run_all.py            # about 6 minutes on the 2-core CPU
    python benchmarks/run_all.py --quick    # fewer timed steps and rows, no ablations

Runs, each in its own process(es): tokenization, the smoke pipeline, the CPU
SFT step comparison (with ablations) and the GPU step (skipped without a GPU).
The figures are compared with the targets in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

HERE = Path(__file__).resolve().parent


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=common.ROOT, capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except OSError:
        return None


def _run(script: str, args: list[str], timeout: float) -> dict:
    print(f"bench: {script} {' '.join(args)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    result = common.run_json([str(HERE / script), *args], timeout=timeout)
    print(f"bench: {script} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(common.RESULTS / "latest.json"))
    args = p.parse_args(argv)
    started = time.perf_counter()
    machine = common.machine()

    tokenize = _run("tokenize_rows.py", ["--rows", "5000" if args.quick else "20000"], timeout=600)
    smoke = _run("smoke_time.py", [], timeout=900)
    cpu_args = ["--steps", "5", "--warmup", "1"] if args.quick else ["--extra", "--bf16"]
    cpu = _run("cpu_sft.py", cpu_args, timeout=1200)
    gpu = _run("gpu_sft.py", [], timeout=1800)

    cpu_keys = [
        "ours_tokens_per_s", "tunix_default_tokens_per_s", "torch_tokens_per_s", "matmul_peak_gflops", "ours_mfu",
        "tunix_default_mfu", "torch_mfu", "ours_vs_tunix_default", "ours_vs_torch",
        "ours_no_cpu_options_tokens_per_s", "ours_no_cpu_options_mfu",
        "tunix_default_with_cpu_options_tokens_per_s", "tunix_default_with_cpu_options_mfu",
        "ours_bf16_compute_tokens_per_s", "torch_bf16_autocast_tokens_per_s",
        # non-padding tokens only: the same steps' useful throughput and the share of padding in them
        "ours_useful_tokens_per_s", "ours_useful_mfu", "ours_padding_fraction", "targets",
    ]
    result = {
        "machine": common.describe(machine),
        "load_average_at_start": machine["load_average"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "command": "make bench" + (" (--quick)" if args.quick else ""),
        "cpu_sft": {
            **{k: cpu.get(k) for k in cpu_keys},
            "setup": {k: cpu.get(k) for k in ("model", "batch", "seq_len", "steps_timed", "warmup_steps", "devices")},
            "detail": {
                k: cpu.get(k)
                for k in ("matmul", "ours", "tunix_default", "torch", "ours_no_cpu_options",
                          "tunix_default_with_cpu_options", "ours_bf16_compute", "torch_bf16_autocast",
                          "error", "stderr_tail")
                if cpu.get(k) is not None
            },
        },
        "tokenize": {k: v for k, v in tokenize.items() if k not in ("machine", "benchmark")},
        "smoke_seconds": smoke.get("smoke_seconds"),
        "smoke": {k: v for k, v in smoke.items() if k not in ("machine", "benchmark", "nodes")},
        "gpu_sft": {k: v for k, v in gpu.items() if k != "machine"},
    }
    result["targets"] = {
        **{f"cpu_sft: {k}": v for k, v in (cpu.get("targets") or {}).items()},
        **{f"tokenize: {k}": v for k, v in (tokenize.get("targets") or {}).items()},
        **{f"smoke: {k}": v for k, v in (smoke.get("targets") or {}).items()},
    }
    result["bench_seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"bench: wrote {out} in {result['bench_seconds']:.0f} s", file=sys.stderr, flush=True)
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
