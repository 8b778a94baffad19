"""The SFT loss: mean next-token NLL over completion tokens, from integer labels.

Tunix's default loss one-hot encodes the whole vocabulary (256k wide for Gemma);
this one takes integer labels, optionally in chunks of positions, and packed rows
attend only within their own example (`model_inputs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tunix_pipeline.config import SftParams


def model_inputs(batch: dict) -> dict:
    """Per-example positions and a causal mask that never crosses examples (segments) or padding."""
    segments = batch["segment_ids"]
    same = segments[:, :, None] == segments[:, None, :]
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    return {
        "input_tokens": batch["input_tokens"],
        "loss_mask": batch["loss_mask"],
        "positions": batch["positions"],
        "attention_mask": same & causal[None] & (segments[:, None, :] > 0),
    }


def _as_dtype(model, dtype):
    """`model` with its floating-point weights cast (differentiably) to `dtype`."""
    graphdef, state = nnx.split(model)
    cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    return nnx.merge(graphdef, cast)


def token_nll(model, input_tokens, loss_mask, positions, attention_mask, chunk_size=None, compute_dtype=None):
    """(sum of next-token NLL over completion tokens, number of such tokens)."""
    if compute_dtype is not None:
        model = _as_dtype(model, compute_dtype)
    logits, _ = model(input_tokens, positions, None, attention_mask)
    logits, targets = logits[:, :-1], input_tokens[:, 1:]
    mask = loss_mask[:, 1:].astype(jnp.float32)
    if chunk_size is None or chunk_size >= logits.shape[1]:
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        return jnp.sum(nll * mask), jnp.sum(mask)

    # chunks of positions, each recomputed in the backward pass: the fp32 softmax
    # over the vocabulary never exists for the whole sequence at once
    pad = -logits.shape[1] % chunk_size
    logits = jnp.pad(logits, ((0, 0), (0, pad), (0, 0)))
    targets, mask = jnp.pad(targets, ((0, 0), (0, pad))), jnp.pad(mask, ((0, 0), (0, pad)))
    b, n = logits.shape[0], logits.shape[1] // chunk_size

    @jax.checkpoint
    def chunk_nll(args):
        lg, tg, mk = args
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(lg.astype(jnp.float32), tg) * mk)

    def split(x):
        return jnp.moveaxis(x.reshape(b, n, chunk_size, *x.shape[2:]), 1, 0)

    return jnp.sum(jax.lax.map(chunk_nll, (split(logits), split(targets), split(mask)))), jnp.sum(mask)


def completion_loss(model, input_tokens, loss_mask, positions, attention_mask, chunk_size=None, compute_dtype=None):
    """Mean NLL over completion tokens, from integer labels (no one-hot)."""
    total, count = token_nll(model, input_tokens, loss_mask, positions, attention_mask, chunk_size, compute_dtype)
    return total / jnp.maximum(count, 1.0)


def loss_fn_for(sft: SftParams):
    dtype = jnp.dtype(sft.compute_dtype) if sft.compute_dtype else None

    def loss(model, input_tokens, loss_mask, positions, attention_mask):
        return completion_loss(model, input_tokens, loss_mask, positions, attention_mask, sft.loss_chunk_size, dtype)

    return loss
