"""lm-evaluation-harness: our JAX backend (`tunix_pipeline.evaluate.harness`) against lm-eval's Hugging Face backend.

    python benchmarks/harness_throughput.py                    # a ~20M-parameter Gemma, 32 documents
    python benchmarks/harness_throughput.py --size tiny --limit 4 --max-gen-toks 8   # seconds

Both backends read the same Hugging Face folder (a Gemma built offline with the tokenizer
trained on the committed data, random weights) and run the same work:

- `generate_until`: the shipped `tagged_answer` task over the project's eval rows
  (`lm_eval.simple_evaluate`, `--limit` documents, greedy, `--max-gen-toks` new tokens each);
  ours generates with Tunix's KV-cache sampler, `hf` with transformers' `generate` on torch;
- `loglikelihood`: log p(completion | prompt) of the same rows, the requests a
  multiple-choice task makes.

Ours runs twice: cold (XLA compiles each shape bucket) and warm. `hf` runs on torch's CPU
threads, ours on XLA:CPU, both in float32, at the same batch size. Prints one JSON object;
`ours_over_hf_*` is our rate over `hf`'s in documents (or requests) per second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

SIZES = {  # TinyModelParams; the vocabulary is what BPE learns from the committed data, at most this
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16),
    "20m": dict(vocab_size=4096, hidden_size=256, intermediate_size=2048, num_layers=9, num_heads=4, num_kv_heads=1,
                head_dim=64),
}


def _rows(tmp: Path, size: str):
    """(model folder, eval rows formatted as the pipeline formats them) from the project's stages."""
    import os

    import yaml

    from tunix_pipeline.config import FormatParams, IngestParams, TinyModelParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest, record_texts
    from tunix_pipeline.models import build_tiny_gemma, load_tokenizer

    conf = common.ROOT / "conf" / "base"
    cwd = os.getcwd()
    os.chdir(common.ROOT)  # the source paths in the config are relative to the project
    try:
        train, evaluation, _ = ingest(IngestParams(**yaml.safe_load((conf / "parameters_ingest.yml").read_text())["ingest"]))
    finally:
        os.chdir(cwd)
    folder = build_tiny_gemma(tmp / "model", record_texts(train), TinyModelParams(**SIZES[size]))
    return folder, format_records(evaluation, load_tokenizer(folder), FormatParams())


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--limit", type=int, default=32, help="documents of the task (and log-likelihood requests)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-gen-toks", type=int, default=48)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from tunix_pipeline.config import HarnessParams, RuntimeParams
    from tunix_pipeline.evaluate import harness
    from tunix_pipeline.models import load_pretrained
    from tunix_pipeline.core.runtime import make_mesh

    tmp = Path(tempfile.mkdtemp(prefix="bench_harness_"))
    folder, formatted = _rows(tmp, args.size)
    params = HarnessParams(enabled=True, limit=args.limit, batch_size=args.batch, max_gen_toks=args.max_gen_toks)
    mesh = make_mesh(RuntimeParams(mesh="auto"))
    (model, tokenizer), load_ours = _timed(lambda: load_pretrained(folder, mesh))
    ours = harness.make_lm(model, tokenizer, mesh, params, folder)
    hf, load_hf = _timed(lambda: HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=args.batch))
    rows = harness.write_rows(formatted, tokenizer, tmp / "eval_rows.jsonl")

    def task(lm):
        return lambda: harness.evaluate(lm, params, rows)["scores"]["tagged_answer"]["strict,none"]

    bos = tokenizer.bos_token
    pairs = [(p.removeprefix(bos), c) for p, c in zip(formatted["prompt"], formatted["completion"])][: args.limit]

    def loglikelihood(lm):
        requests = [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i) for i, a in enumerate(pairs)]
        return lambda: [r[0] for r in lm.loglikelihood(requests, disable_tqdm=True)]

    out: dict = {"size": args.size, "limit": args.limit, "batch": args.batch, "max_gen_toks": args.max_gen_toks,
                 "lm_eval": lm_eval.__version__, "load_seconds": {"ours": load_ours, "hf": load_hf}}
    for name, work, n in (("generate_until", task, args.limit), ("loglikelihood", loglikelihood, len(pairs))):
        cold, ours_cold = _timed(work(ours))
        warm, ours_warm = _timed(work(ours))
        theirs, hf_seconds = _timed(work(hf))
        out[name] = {
            "items": n,
            "ours_cold_seconds": ours_cold,
            "ours_warm_seconds": ours_warm,
            "hf_seconds": hf_seconds,
            "ours_per_s": n / ours_warm,
            "hf_per_s": n / hf_seconds,
            "ours_over_hf_warm": hf_seconds / ours_warm,
            "ours_over_hf_cold": hf_seconds / ours_cold,
        }
        if name == "generate_until":
            out[name]["strict"] = {"ours": warm, "hf": theirs}  # tagged_answer's strict reading
        else:
            import numpy as np

            out[name]["max_abs_difference"] = float(np.max(np.abs(np.subtract(warm, theirs))))
    out["machine"] = common.machine()
    common.emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
