"""Continuous batching's state and its pure helpers (`Sampler.generate_rows` in `upstream/generation.py`): the
slots' state, Tunix's KV cache mapped slot by slot, the bucketed prefill lengths, the stop-string matcher and the
repeat rule."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
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


def repeating(buffer, step, first, block: int) -> jax.Array:
    """Rows whose newest tokens repeat themselves: for some length L from `block` to 2 x `block` - 1, the L tokens
    through buffer index `step` equal the L before them, all 2 L the row's own new tokens (from index `first`). A loop
    of any period under 2 x `block` is caught (a multiple of a shorter period lies in that range) once it has gone
    round twice; greedy decoding in a loop does not leave it."""
    back = step - jnp.arange(4 * block - 2)  # buffer indices, newest first
    tokens = jnp.take(buffer, jnp.maximum(back, 0), axis=1)
    found = jnp.zeros(buffer.shape[0], bool)
    for length in range(block, 2 * block):
        same = jnp.all(tokens[:, :length] == tokens[:, length : 2 * length], axis=1)
        found |= same & (back[2 * length - 1] >= first)
    return found


def ends_repeating(tokens, block: int) -> bool:
    """`repeating` on one finished row's kept tokens: does it end with a block repeated back to back?"""
    tokens = np.asarray(tokens)
    return any(len(tokens) >= 2 * n and np.array_equal(tokens[-n:], tokens[-2 * n : -n]) for n in range(block, 2 * block))
