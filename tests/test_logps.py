"""GRPO's log-probs with the output layer at the completion's positions only (`upstream.completion_logits_only`):
the same log-probs, logits and gradients as Tunix's `compute_per_token_logps`, for every family's tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix.rl import common

from tunix_pipeline import upstream
from tunix_pipeline.models.families import family_for
from tunix_pipeline.models.loading import run_config

from .test_family_gemma import _config as gemma
from .test_family_gemma2 import _config as gemma2
from .test_family_gemma3 import _config as gemma3
from .test_family_llama import _config as llama
from .test_family_qwen import _qwen2, _qwen3

CONFIGS = {
    "gemma": lambda: gemma(),
    "gemma2-final-softcap": lambda: gemma2(),
    "gemma3-final-softcap": lambda: gemma3(num_key_value_heads=2, final_logit_softcapping=3.0),
    "llama-untied": lambda: llama(),
    "llama-tied": lambda: llama(tie_word_embeddings=True),
    "qwen2": lambda: _qwen2(),
    "qwen3-tied": lambda: _qwen3(tie_word_embeddings=True),
}
PAD, VOCAB = 0, 256


def tiny_model(name):
    """The family's model with random float32 weights (Tunix's Gemma 3 initialises bfloat16 ones)."""
    hf = CONFIGS[name]().to_dict()
    family = family_for(hf)
    model = family.model_class(run_config(family, hf), rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model, nnx.Param)))
    return model


def batch():
    """Three left-padded prompts (7 slots) and right-padded completions (5 slots), as GRPO's rollout gives them."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, VOCAB, (3, 7)).astype(np.int32)
    completion = rng.integers(3, VOCAB, (3, 5)).astype(np.int32)
    prompt[1, :2] = prompt[2, :5] = PAD
    completion[0, 3:] = completion[2, 1:] = PAD
    return jnp.asarray(prompt), jnp.asarray(completion)


def logps(graphdef, state, **kwargs):
    prompt, completion = batch()
    return common.compute_per_token_logps(graphdef, state, prompt, completion, pad_id=PAD, eos_id=1, **kwargs)


def loss(state, graphdef):
    """A GRPO-like scalar of the completion's log-probs and their logits (the loss's entropy term)."""
    values, logits = logps(graphdef, state, stop_gradient=False, return_logits=True, temperature=0.9)
    mask = batch()[1] != PAD
    return jnp.sum(values * mask) + 1e-2 * jnp.sum(jax.nn.logsumexp(logits, axis=-1) * mask)


def full_logits_made(fn, *args) -> bool:
    """Does `fn` make the (batch, prompt + completion, vocabulary) logits anywhere?"""
    return "[3,12,256]" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_completion_logits_give_tunixs_log_probs_and_gradients(name):
    graphdef, state = nnx.split(tiny_model(name))
    expected, expected_logits = logps(graphdef, state, return_logits=True)
    expected_grad = jax.grad(loss)(state, graphdef)
    assert full_logits_made(lambda s: logps(graphdef, s), state)
    original = common.compute_per_token_logps
    with upstream.completion_logits_only():
        got, got_logits = logps(graphdef, state, return_logits=True)
        grad = jax.grad(loss)(state, graphdef)
        assert not full_logits_made(lambda s: logps(graphdef, s), state)
    assert common.compute_per_token_logps is original
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(expected_logits), atol=1e-5, rtol=0)
    assert_gradients_close(grad, expected_grad)


def assert_gradients_close(grad, expected):
    """Every gradient within 1e-5 of the expected one's largest element."""
    flat, flat_expected = nnx.to_flat_state(grad), dict(nnx.to_flat_state(expected))
    assert len(flat) == len(flat_expected)
    for path, value in flat:
        scale = float(np.abs(np.asarray(flat_expected[path][...])).max()) or 1.0
        np.testing.assert_allclose(np.asarray(value[...]), np.asarray(flat_expected[path][...]),
                                   atol=1e-5 * scale, rtol=0, err_msg=".".join(map(str, path)))


class Wrapped(nnx.Module):
    """A model class the patch does not know: its `__call__` need not end with a final norm."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens, positions, cache, attention_mask):  # no **kwargs: Tunix would pass segment_ids
        return self.inner(tokens, positions, cache, attention_mask)


def test_other_models_take_tunixs_path():
    graphdef, state = nnx.split(Wrapped(tiny_model("gemma")))
    expected = logps(graphdef, state)
    with upstream.completion_logits_only():
        assert full_logits_made(lambda s: logps(graphdef, s), state)
        np.testing.assert_array_equal(np.asarray(logps(graphdef, state)), np.asarray(expected))
