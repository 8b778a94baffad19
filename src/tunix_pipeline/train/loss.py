"""The SFT loss: mean next-token NLL over completion tokens, from integer labels.

Tunix's default loss one-hot encodes the whole vocabulary (256k wide for Gemma) and
runs the output layer at every position; this one takes integer labels and runs the
output layer at the completion's positions only, a chunk at a time (`target_logps`,
which preference's log-probabilities share). Packed rows attend only within their
own example (`model_inputs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tunix_pipeline import upstream
from tunix_pipeline.config import DEFAULT_LOSS_CHUNK, SftParams


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


def target_logps(model, input_tokens, target_mask, positions, attention_mask, chunk_size: int = DEFAULT_LOSS_CHUNK):
    """Per row, the summed log-probability of the tokens where `target_mask` is set, each predicted from the
    positions before it.

    The output layer runs only at those positions (each row's moved to its front, in order), `chunk_size` of them
    per row at a time, only as many chunks as the row with the most targets fills (`chunked_logps`), so neither
    the [batch, length, vocabulary] logits nor their gradient ever exist whole. Models whose call we cannot split
    (`upstream.decoder_and_output_layer`) give their whole logits."""
    targets, mask = input_tokens[:, 1:], target_mask[:, 1:].astype(jnp.float32)
    split = upstream.decoder_and_output_layer(model)
    if split is None:
        logits, _ = model(input_tokens, positions, None, attention_mask)
        return -jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), targets)
                        * mask, axis=1)
    decoder, output_layer, head = split
    hidden = decoder(input_tokens, positions, attention_mask)[:, :-1]
    order = jnp.argsort(mask == 0, axis=1, stable=True)
    hidden = jnp.take_along_axis(hidden, order[:, :, None], axis=1)
    targets, mask = jnp.take_along_axis(targets, order, axis=1), jnp.take_along_axis(mask, order, axis=1)
    rows, length = mask.shape
    chunk = min(chunk_size, length)
    pad = -length % chunk

    def chunks(x):  # [rows, length, ...] -> [chunks, rows, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(rows, -1, chunk, *x.shape[2:]), 1, 0)

    used = (jnp.max(jnp.sum(mask, axis=1)).astype(jnp.int32) + chunk - 1) // chunk
    return chunked_logps(output_layer, head, chunks(hidden), chunks(targets), chunks(mask), used)


def chunked_logps(output_layer, head, hidden, targets, mask, used):
    """Per row, the summed target log-probabilities of the first `used` chunks of `hidden` ([chunks, rows, chunk,
    width]; the rest hold no target), with `output_layer(head, hidden)` the logits.

    A loop over the chunks forwards and backwards, written out (custom VJP), and the loop's bound is a value, so
    chunks without targets cost nothing (differentiated through a `cond` instead, XLA:TPU keeps a head-sized
    gradient per branch: +3 GB for Gemma-2B at 1 x 1024). A frozen head (LoRA): the forward pass also computes each
    row's gradient w.r.t. its hidden states from the logits it has (a row's gradient is its own cotangent times
    it), so no logits are computed twice. A trained head: the backward pass recomputes a chunk's logits and adds up
    the head's gradient, which needs the rows' cotangents."""
    rows = hidden.shape[1]

    def chunk_logps(k, head, hidden_k):
        logits = output_layer(head, hidden_k)
        return -jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets[k]) * mask[k], axis=1)

    @jax.custom_vjp
    def logps(head, hidden):
        return jax.lax.fori_loop(0, used, lambda k, total: total + chunk_logps(k, head, hidden[k]),
                                 jnp.zeros((rows,), jnp.float32))

    trained = []  # whether any of the head's weights is differentiated (set while the forward rule traces)

    def forward(head, hidden):
        trained.append(any(leaf.perturbed for leaf in jax.tree.leaves(head)))
        head, hidden = jax.custom_derivatives.custom_vjp_primal_tree_values((head, hidden))
        if trained[-1]:
            return logps(head, hidden), (head, hidden, None)

        def step(k, carry):
            total, d_hidden = carry
            values, row_gradients = jax.vjp(lambda x: chunk_logps(k, head, x), hidden[k])
            (g_hidden,) = row_gradients(jnp.ones((rows,), jnp.float32))
            return total + values, d_hidden.at[k].set(g_hidden.astype(d_hidden.dtype))

        total, d_hidden = jax.lax.fori_loop(0, used, step, (jnp.zeros((rows,), jnp.float32), jnp.zeros_like(hidden)))
        return total, (head, hidden, d_hidden)

    def backward(residuals, row_cotangent):
        head, hidden, d_hidden = residuals
        if d_hidden is not None:
            return None, (d_hidden * row_cotangent[None, :, None, None].astype(d_hidden.dtype))

        def step(k, grads):
            d_head, d_hidden = grads
            weighted = lambda h, x: jnp.sum(chunk_logps(k, h, x) * row_cotangent)  # noqa: E731
            g_head, g_hidden = jax.grad(weighted, argnums=(0, 1))(head, hidden[k])
            return jax.tree.map(jnp.add, d_head, g_head), d_hidden.at[k].set(g_hidden.astype(d_hidden.dtype))

        zero = (jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(hidden))
        return jax.lax.fori_loop(0, used, step, zero)

    logps.defvjp(forward, backward, symbolic_zeros=True)
    return logps(head, hidden)


def token_nll(model, input_tokens, loss_mask, positions, attention_mask, chunk_size: int = DEFAULT_LOSS_CHUNK,
              compute_dtype=None):
    """(sum of next-token NLL over completion tokens, number of such tokens)."""
    if compute_dtype is not None:
        model = _as_dtype(model, compute_dtype)
    logps = target_logps(model, input_tokens, loss_mask, positions, attention_mask, chunk_size)
    return -jnp.sum(logps), jnp.sum(loss_mask[:, 1:].astype(jnp.float32))


def completion_loss(model, input_tokens, loss_mask, positions, attention_mask, chunk_size: int = DEFAULT_LOSS_CHUNK,
                    compute_dtype=None):
    """Mean NLL over completion tokens, from integer labels (no one-hot)."""
    total, count = token_nll(model, input_tokens, loss_mask, positions, attention_mask, chunk_size, compute_dtype)
    return total / jnp.maximum(count, 1.0)


def loss_fn_for(sft: SftParams):
    dtype = jnp.dtype(sft.compute_dtype) if sft.compute_dtype else None

    def loss(model, input_tokens, loss_mask, positions, attention_mask):
        return completion_loss(model, input_tokens, loss_mask, positions, attention_mask, sft.loss_chunk_size, dtype)

    return loss
