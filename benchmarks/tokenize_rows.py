"""Tokenization: rows/s of our `tokenize` stage function against a plain batched tokenizer call.

    python benchmarks/tokenize_rows.py               # the committed dataset, repeated to --rows rows
    python benchmarks/tokenize_rows.py --rows 200 --repeats 1    # seconds

Both tokenize the same formatted rows (ingest -> format of `data/01_raw`, the
prompt and completion of each) with the same fast tokenizer (the tiny model's,
trained on that data) to the same fixed length:

- `ours`: `tunix_pipeline.data.tokenization.tokenize_split` (what the tokenize node
  runs): token ids, completion-only loss mask, segment ids, positions, stats;
- `plain`: one batched call, `tokenizer(prompt + completion, truncation=True,
  max_length=L, padding="max_length", return_tensors="np")`: the ids and an
  attention mask only, what a hand-written notebook would do.

Best of `--repeats` runs each, interleaved; beside rows/s, the token slots our
rows hold per second and the real (non-padding) tokens among them, with the
rows' padding efficiency. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402


def formatted_rows(rows: int, tmp: Path):
    """(formatted rows, tokenizer, tokenize params) from the project's own stages and config."""
    import os

    import pandas as pd
    import yaml

    from tunix_pipeline.config import FormatParams, IngestParams, TinyModelParams, TokenizeParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest, record_texts
    from tunix_pipeline.models import build_tiny_gemma, load_tokenizer

    conf = common.ROOT / "conf" / "base"
    cwd = os.getcwd()
    os.chdir(common.ROOT)  # the source paths in the config are relative to the project
    try:
        ingest_params = IngestParams(**yaml.safe_load((conf / "parameters_ingest.yml").read_text())["ingest"])
        train, _, _ = ingest(ingest_params)
    finally:
        os.chdir(cwd)
    tiny = yaml.safe_load((conf / "parameters_base_model.yml").read_text())["model"]["tiny"]
    folder = build_tiny_gemma(tmp / "tiny", record_texts(train), TinyModelParams(**tiny))
    tokenizer = load_tokenizer(folder)
    formatted = format_records(
        train, tokenizer, FormatParams(**yaml.safe_load((conf / "parameters_format.yml").read_text())["format"])
    )
    reps = -(-rows // len(formatted))
    formatted = pd.concat([formatted] * reps, ignore_index=True).iloc[:rows].copy()
    formatted["id"] = [f"{i}" for i in range(len(formatted))]
    params = TokenizeParams(**yaml.safe_load((conf / "parameters_tokenize.yml").read_text())["tokenize"])
    return formatted, tokenizer, params


def run(args) -> dict:
    from tunix_pipeline.data.tokenization import tokenize_split

    with tempfile.TemporaryDirectory() as tmp:
        formatted, tokenizer, params = formatted_rows(args.rows, Path(tmp))
    n = len(formatted)
    texts = (formatted["prompt"] + formatted["completion"]).tolist()

    stats = {}

    def ours():
        rows, written = tokenize_split(formatted, tokenizer, params)
        stats.update(written)
        return rows

    def plain():
        return tokenizer(
            texts,
            add_special_tokens=False,
            truncation=True,
            max_length=params.max_length,
            padding="max_length",
            return_tensors="np",
        )

    times = {"ours": [], "plain": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("plain", plain)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    result = {
        "benchmark": "tokenize",
        "machine": common.describe(common.machine()),
        "rows": n,
        "max_length": params.max_length,
        "pack": params.pack,
        "repeats": args.repeats,
        "ours_seconds": best["ours"],
        "plain_seconds": best["plain"],
        "ours_rows_per_s": n / best["ours"],
        "plain_rows_per_s": n / best["plain"],
        "ours_vs_plain": best["plain"] / best["ours"],
        # the rows as written: every slot, and the real tokens among them (their padding efficiency)
        "padding_efficiency": stats["padding_efficiency"],
        "ours_tokens_per_s": stats["rows_out"] * params.max_length / best["ours"],
        "ours_useful_tokens_per_s": stats["padding_efficiency"] * stats["rows_out"] * params.max_length / best["ours"],
        "tokenizer": type(tokenizer).__name__,
        "all_seconds": times,
    }
    result["targets"] = {"ours_vs_plain >= 0.9": result["ours_vs_plain"] >= 0.9}
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = run(args)
    common.emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
