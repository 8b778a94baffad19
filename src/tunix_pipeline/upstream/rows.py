"""Continuous batching's state and its pure helpers (`Sampler.generate_rows` in `upstream/generation.py`): the
slots' state, Tunix's KV cache mapped slot by slot, the bucketed prefill lengths and the stop-string matcher."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from tunix.generate import sampler as sampler_lib


class Rows(NamedTuple):
    """Continuous batching's state: Tunix's sampling state over the batch's slots (one decode step and cache write
    index for all), and per slot the buffer index of its row's first new token, one past its last kept token, and
    how many characters of each stop string its text ends with."""

    state: sampler_lib._SamplingState
    first: jax.Array
    end: jax.Array
    matched: jax.Array


def map_cache(slots_fn, index_fn, *caches):
    """Tunix's KV caches (per layer: `k` and `v`, (batch, cache positions, ...), and the write index `end_index`,
    (batch,)): `slots_fn` over the slot arrays, `index_fn` over the write indices."""
    def leaf(path, *xs):
        return index_fn(*xs) if getattr(path[-1], "key", None) == "end_index" else slots_fn(*xs)

    return jax.tree_util.tree_map_with_path(leaf, *caches)


def prefill_length(longest: int, limit: int) -> int:
    """The padded length a lot of prompts is prefilled at: the next of 16, 24, 32, 48, 64, 96, ... (powers of two and
    one and a half times them), at most `limit`; few compiled lengths, at most a third of padding."""
    size = 16
    while size < longest:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, limit)


def stop_string_table(texts: list[str], stop: str) -> np.ndarray:
    """(tokens, len(`stop`)) int8: for a text ending with the first q characters of `stop` (and not holding it whole),
    `table[token, q]` is how many it ends with once `texts[token]` follows, len(`stop`) when it then holds `stop`.
    A string matcher over tokens: exact whatever tokenization spells `stop` (`</`+`answer`+`>`, ` </`+`answer`+`>.`)."""
    n = len(stop)
    table = np.zeros((len(texts), n), np.int8)
    pieces, rests = {stop[i:j] for i in range(n) for j in range(i + 1, n + 1)}, tuple(stop[i:] for i in range(1, n))
    for token, text in enumerate(texts):
        if not text:
            table[token] = np.arange(n)  # spells nothing: the match stands
            continue
        # only a token that holds the first character, is a piece of `stop` or starts with its rest can leave a match
        if stop[0] not in text and text not in pieces and not text.startswith(rests):
            continue
        for q in range(n):
            joined = stop[:q] + text
            table[token, q] = n if stop in joined else next(k for k in range(min(n - 1, len(joined)), -1, -1)
                                                            if joined.endswith(stop[:k]))
    return table
