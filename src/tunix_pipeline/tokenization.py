"""Fixed-length tokenization with a completion-only loss mask.

Every row becomes exactly `max_length` tokens (static shapes: XLA compiles
the train step once). `loss_mask` is 1 on completion tokens only;
`attention_mask` is 1 on real tokens. Overlong rows are truncated at the end
(`truncate`) or dropped (`drop`); a row whose prompt alone fills the length
has nothing to learn from and is dropped either way. Both are counted.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tunix_pipeline.config import TokenizeParams

TOKEN_COLUMNS = ["id", "input_tokens", "loss_mask", "attention_mask"]


def tokenize_split(
    formatted: pd.DataFrame, tokenizer, params: TokenizeParams
) -> tuple[pd.DataFrame, dict]:
    """Formatted rows -> (token rows, stats)."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; add one to the model folder's tokenizer_config.json"
        )
    n = len(formatted)
    max_len = params.max_length
    # One batched call per column: the fast tokenizer parallelises internally.
    prompts = tokenizer(formatted["prompt"].tolist(), add_special_tokens=False)["input_ids"] if n else []
    completions = (
        tokenizer(formatted["completion"].tolist(), add_special_tokens=False)["input_ids"] if n else []
    )
    tokens = np.full((n, max_len), tokenizer.pad_token_id, dtype=np.int32)
    loss_mask = np.zeros((n, max_len), dtype=np.int32)
    keep = np.ones(n, dtype=bool)
    lengths = np.zeros(n, dtype=np.int64)
    truncated = dropped_overlong = dropped_no_completion = 0
    for i, (p, c) in enumerate(zip(prompts, completions)):
        full = len(p) + len(c)
        lengths[i] = full
        if len(p) >= max_len:
            keep[i] = False
            dropped_no_completion += 1
            continue
        if full > max_len:
            if params.overflow == "drop":
                keep[i] = False
                dropped_overlong += 1
                continue
            truncated += 1
        row = (p + c)[:max_len]
        tokens[i, : len(row)] = row
        loss_mask[i, len(p) : len(row)] = 1
    attention = np.zeros_like(loss_mask)
    for i in range(n):
        attention[i, : min(lengths[i], max_len)] = 1

    tokens, loss_mask, attention = tokens[keep], loss_mask[keep], attention[keep]
    rows = pd.DataFrame(
        {
            "id": formatted["id"].to_numpy()[keep],
            "input_tokens": list(tokens),
            "loss_mask": list(loss_mask),
            "attention_mask": list(attention),
        },
        columns=TOKEN_COLUMNS,
    )
    counts, edges = np.histogram(lengths, bins=params.histogram_bins) if n else ([], [])
    stats = {
        "rows_in": n,
        "rows_out": int(keep.sum()),
        "truncated": truncated,
        "dropped_overlong": dropped_overlong,
        "dropped_prompt_too_long": dropped_no_completion,
        "max_length": max_len,
        "mean_length": float(lengths.mean()) if n else 0.0,
        "max_seen_length": int(lengths.max()) if n else 0,
        # share of the fixed-length slots that hold real tokens
        "padding_efficiency": float(attention.mean()) if len(attention) else 0.0,
        "completion_token_fraction": float(loss_mask.sum() / max(attention.sum(), 1)),
        "length_histogram": {
            "counts": [int(c) for c in counts],
            "bin_edges": [float(e) for e in edges],
        },
    }
    return rows, stats


def stack(rows: pd.DataFrame, column: str) -> np.ndarray:
    """A token column (one array per row, as read back from Parquet) as a 2-D array."""
    return np.stack(rows[column].to_numpy()).astype(np.int32)
