"""Fixed-length tokenization with a completion-only loss mask, and optional packing.

Every row becomes exactly `max_length` tokens (static shapes: XLA compiles
the train step once). Columns:
- `input_tokens`: the tokens, right-padded;
- `loss_mask`: 1 on completion tokens only;
- `segment_ids`: 1, 2, … for each example in the row, 0 on padding;
- `positions`: each example's own positions, restarting at 0 per segment.

Without packing a row holds one example (segment 1). With `pack: true`
several short examples share a row; segment ids keep attention within each
example and positions restart, so a packed batch computes the same loss as
the unpacked one with less padding. Overlong examples are truncated at the end
(`truncate`) or dropped (`drop`); one whose prompt alone fills the length has
nothing to learn from and is dropped either way. A row with no completion (an
open-ended prompt without a reference) has nothing to learn from either: it is
skipped. All three are counted.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tunix_pipeline.config import TokenizeParams
from tunix_pipeline.core.errors import ModelError

TOKEN_COLUMNS = ["id", "input_tokens", "loss_mask", "segment_ids", "positions"]


def tokenize_split(formatted: pd.DataFrame, tokenizer, params: TokenizeParams) -> tuple[pd.DataFrame, dict]:
    """Formatted rows -> (fixed-length token rows, stats)."""
    if tokenizer.pad_token_id is None:
        raise ModelError("the tokenizer has no pad token; add one to the model folder's tokenizer_config.json")
    prompt_only = formatted["completion"] == ""  # they serve GRPO and evaluation as prompts
    formatted = formatted[~prompt_only]
    n = len(formatted)
    max_len = params.max_length
    # One batched call for prompts and completions together: the fast tokenizer parallelises internally.
    encoded = encode_batch(tokenizer, formatted["prompt"].tolist() + formatted["completion"].tolist()) if n else []
    prompts, completions = encoded[:n], encoded[n:]
    row_ids = formatted["id"].astype(str).tolist()

    # each kept example as (prompt tokens, completion tokens), the completion cut to fit max_length
    examples, ids = [], []
    lengths = np.zeros(n, dtype=np.int64)
    truncated = dropped_overlong = dropped_no_completion = 0
    for i, (p, c) in enumerate(zip(prompts, completions)):
        lengths[i] = len(p) + len(c)
        if len(p) >= max_len:
            dropped_no_completion += 1
            continue
        if lengths[i] > max_len:
            if params.overflow == "drop":
                dropped_overlong += 1
                continue
            truncated += 1
            c = c[: max_len - len(p)]
        examples.append((p, c))
        ids.append(row_ids[i])

    sizes = [len(p) + len(c) for p, c in examples]
    groups = _pack(sizes, max_len) if params.pack else [[i] for i in range(len(examples))]
    rows = _rows(examples, ids, groups, max_len, tokenizer.pad_token_id)
    real_tokens = sum(sizes)
    efficiency = real_tokens / (len(rows) * max_len) if len(rows) else 0.0
    counts, edges = np.histogram(lengths, bins=params.histogram_bins) if n else ([], [])
    stats = {
        "rows_in": n + int(prompt_only.sum()),
        "skipped_prompt_only": int(prompt_only.sum()),
        "examples_out": len(examples),
        "rows_out": len(rows),
        "packed": params.pack,
        "truncated": truncated,
        "dropped_overlong": dropped_overlong,
        "dropped_prompt_too_long": dropped_no_completion,
        "max_length": max_len,
        "mean_length": float(lengths.mean()) if n else 0.0,
        "max_seen_length": int(lengths.max()) if n else 0,
        # share of the fixed-length slots that hold real tokens, as written and with one example per row
        "padding_efficiency": efficiency,
        "padding_efficiency_unpacked": real_tokens / (len(examples) * max_len) if examples else 0.0,
        # what `pack: true` gives (as written when packing; else first-fit decreasing on these lengths): the plan
        # states the time packing would save
        "padding_efficiency_packed": efficiency if params.pack else packed_efficiency(sizes, max_len),
        "completion_token_fraction": sum(len(c) for _, c in examples) / max(real_tokens, 1),
        "length_histogram": {"counts": [int(c) for c in counts], "bin_edges": [float(e) for e in edges]},
    }
    return rows, stats


def encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added: `tokenizer(texts)["input_ids"]`.

    A fast tokenizer's Rust backend is called directly when it has no truncation
    or padding configured (then the two are the same): it skips transformers'
    per-row Python conversion, about a third of the stage's time.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def packed_efficiency(sizes: list[int], max_len: int, sample: int = 4096) -> float:
    """Share of real tokens in the rows `_pack` makes of `sizes`; of a seeded sample of `sample` of them when there
    are more (first-fit decreasing takes time quadratic in the examples; the sample estimates it within ~1%)."""
    if not sizes:
        return 0.0
    if len(sizes) > sample:
        sizes = np.random.default_rng(0).choice(sizes, sample, replace=False).tolist()
    return sum(sizes) / (len(_pack(sizes, max_len)) * max_len)


def _pack(sizes: list[int], max_len: int) -> list[list[int]]:
    """First-fit decreasing: example indices per row, each row's total length <= max_len."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    rows, free = [], []
    for i in order:
        size = sizes[i]
        slot = next((r for r, space in enumerate(free) if space >= size), None)
        if slot is None:
            rows.append([i])
            free.append(max_len - size)
        else:
            rows[slot].append(i)
            free[slot] -= size
    return rows


def _rows(examples, ids, groups, max_len: int, pad_id: int) -> pd.DataFrame:
    n = len(groups)
    tokens = np.full((n, max_len), pad_id, dtype=np.int32)
    loss = np.zeros((n, max_len), dtype=np.int32)
    segments = np.zeros((n, max_len), dtype=np.int32)
    positions = np.zeros((n, max_len), dtype=np.int32)
    ramp = np.arange(max_len, dtype=np.int32)
    for r, group in enumerate(groups):
        start = 0
        for segment, i in enumerate(group, start=1):
            p, c = examples[i]
            middle, end = start + len(p), start + len(p) + len(c)
            tokens[r, start:middle] = p
            tokens[r, middle:end] = c
            loss[r, middle:end] = 1
            segments[r, start:end] = segment
            positions[r, start:end] = ramp[: end - start]
            start = end
    return pd.DataFrame(
        {
            "id": [",".join(ids[i] for i in group) for group in groups],
            "input_tokens": list(tokens),
            "loss_mask": list(loss),
            "segment_ids": list(segments),
            "positions": list(positions),
        },
        columns=TOKEN_COLUMNS,
    )


def stack(rows: pd.DataFrame, column: str) -> np.ndarray:
    """A token column (one array per row, as read back from Parquet) as a 2-D array."""
    return np.stack(rows[column].to_numpy()).astype(np.int32)


def token_arrays(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    """The model-input columns as 2-D arrays."""
    return {c: stack(rows, c) for c in TOKEN_COLUMNS[1:]}
