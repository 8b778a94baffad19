"""Exact token choice over a whole vocabulary, cheaper than `jax.random.categorical` on a CPU: the maths of
`upstream.Sampler`'s temperature sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_inverse_cdf(key, logits, blocks: int = 512):
    """One token per row drawn from softmax(`logits`) (rows, vocabulary), exactly, by the inverse CDF: one uniform
    picks a block of the vocabulary by its probability mass, a second a word inside it. `jax.random.categorical`
    draws a Gumbel variate per word instead: 65 ms a step for 8 rows of 262k words on a 2-core CPU, against 1.3."""
    rows, vocab = logits.shape
    logits = jnp.pad(logits, ((0, 0), (0, -vocab % blocks)), constant_values=-jnp.inf)
    mass = jnp.exp(logits - logits.max(axis=-1, keepdims=True)).reshape(rows, blocks, -1)
    u = jax.random.uniform(key, (2, rows))

    def pick(weights, v):  # the first index whose running total passes v x the total
        running = jnp.cumsum(weights, axis=-1)
        return jnp.minimum(jnp.sum(running <= (v * running[:, -1])[:, None], axis=-1), weights.shape[-1] - 1)

    block = pick(mass.sum(axis=-1), u[0])
    inside = jnp.take_along_axis(mass, block[:, None, None], axis=1)[:, 0]
    return block * inside.shape[-1] + pick(inside, u[1])
