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
nothing to learn from and is dropped either way. Both are counted.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tunix_pipeline.config import TokenizeParams

TOKEN_COLUMNS = ["id", "input_tokens", "loss_mask", "segment_ids", "positions"]


def tokenize_split(formatted: pd.DataFrame, tokenizer, params: TokenizeParams) -> tuple[pd.DataFrame, dict]:
    """Formatted rows -> (fixed-length token rows, stats)."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; add one to the model folder's tokenizer_config.json")
    n = len(formatted)
    max_len = params.max_length
    # One batched call per column: the fast tokenizer parallelises internally.
    prompts = tokenizer(formatted["prompt"].tolist(), add_special_tokens=False)["input_ids"] if n else []
    completions = tokenizer(formatted["completion"].tolist(), add_special_tokens=False)["input_ids"] if n else []

    examples, ids = [], []  # (tokens, loss mask) of each kept example
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
        tokens = (p + c)[:max_len]
        examples.append((tokens, [0] * len(p) + [1] * (len(tokens) - len(p))))
        ids.append(str(formatted["id"].iloc[i]))

    groups = _pack(examples, max_len) if params.pack else [[i] for i in range(len(examples))]
    rows = _rows(examples, ids, groups, max_len, tokenizer.pad_token_id)
    real_tokens = sum(len(t) for t, _ in examples)
    counts, edges = np.histogram(lengths, bins=params.histogram_bins) if n else ([], [])
    stats = {
        "rows_in": n,
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
        "padding_efficiency": real_tokens / (len(rows) * max_len) if len(rows) else 0.0,
        "padding_efficiency_unpacked": real_tokens / (len(examples) * max_len) if examples else 0.0,
        "completion_token_fraction": sum(sum(m) for _, m in examples) / max(real_tokens, 1),
        "length_histogram": {"counts": [int(c) for c in counts], "bin_edges": [float(e) for e in edges]},
    }
    return rows, stats


def _pack(examples: list[tuple[list, list]], max_len: int) -> list[list[int]]:
    """First-fit decreasing: example indices per row, each row's total length <= max_len."""
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i][0]))
    rows, free = [], []
    for i in order:
        size = len(examples[i][0])
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
    for r, group in enumerate(groups):
        start = 0
        for segment, i in enumerate(group, start=1):
            toks, mask = examples[i]
            end = start + len(toks)
            tokens[r, start:end] = toks
            loss[r, start:end] = mask
            segments[r, start:end] = segment
            positions[r, start:end] = np.arange(len(toks))
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
