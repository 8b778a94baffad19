"""SFT's loss and preference's log-probabilities with the output layer at the target positions only, a chunk at a
time (`loss.target_logps`): the same values and gradients as the model's whole logits, for every family's tiny
model, packed rows and LoRA included, and no (batch, length, vocabulary) logits anywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.sft.dpo import dpo_trainer

from tunix_pipeline.config import LoraParams
from tunix_pipeline.models.lora import apply_lora
from tunix_pipeline.train import preference
from tunix_pipeline.train.loss import model_inputs, token_nll

from .test_logps import CONFIGS, VOCAB, assert_gradients_close, tiny_model

ROWS, LENGTH = 3, 12


def packed_batch():
    """Three rows of 12 slots: two examples packed in the first, one in the second, the third half padding; the
    completions (loss mask) are of different lengths, so chunks of 2 leave whole chunks without targets."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, VOCAB, (ROWS, LENGTH)).astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 7, [1] * 12, [1] * 6 + [0] * 6])
    positions = np.array([list(range(5)) + list(range(7)), list(range(12)), list(range(6)) + [0] * 6])
    loss_mask = np.zeros((ROWS, LENGTH), np.int32)
    loss_mask[0, 3:5] = loss_mask[0, 9:12] = loss_mask[1, 4:12] = loss_mask[2, 5:6] = 1
    tokens[2, 6:] = 0
    return model_inputs({"input_tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments),
                         "positions": jnp.asarray(positions), "loss_mask": jnp.asarray(loss_mask)})


def whole_logits_nll(model, input_tokens, loss_mask, positions, attention_mask):
    logits, _ = model(input_tokens, positions, None, attention_mask)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), input_tokens[:, 1:])
    return jnp.sum(nll * loss_mask[:, 1:]), jnp.sum(loss_mask[:, 1:].astype(jnp.float32))


def whole_logits_made(fn, *args) -> bool:
    return f"[{ROWS},{LENGTH},{VOCAB}]" in str(jax.make_jaxpr(fn)(*args)) or \
        f"[{ROWS},{LENGTH - 1},{VOCAB}]" in str(jax.make_jaxpr(fn)(*args))


def model_for(name: str, lora: bool):
    model = tiny_model(name)
    return apply_lora(model, LoraParams(rank=2, alpha=4.0)) if lora else model


@pytest.mark.slow
@pytest.mark.parametrize("name, lora", [(n, False) for n in CONFIGS] + [("gemma3-final-softcap", True), ("qwen2", True)])
def test_sft_loss_and_gradients_equal_the_whole_logits(name, lora):
    model = model_for(name, lora)
    batch = packed_batch()
    wrt = nnx.LoRAParam if lora else nnx.Param

    def mean(fn, m):
        total, count = fn(m, **batch)
        return total / count

    expected, expected_grad = nnx.value_and_grad(lambda m: mean(whole_logits_nll, m), argnums=nnx.DiffState(0, wrt))(model)
    for chunk in (2, 64):  # skipped chunks and a padded last one (11 positions), one chunk
        got, grad = nnx.value_and_grad(lambda m: mean(lambda mm, **b: token_nll(mm, **b, chunk_size=chunk), m),
                                       argnums=nnx.DiffState(0, wrt))(model)
        np.testing.assert_allclose(float(got), float(expected), atol=1e-5, rtol=0)
        assert_gradients_close(grad, expected_grad)
    graphdef, state = nnx.split(model)
    assert whole_logits_made(lambda s: whole_logits_nll(nnx.merge(graphdef, s), **batch), state)
    assert not whole_logits_made(lambda s: token_nll(nnx.merge(graphdef, s), **batch, chunk_size=2), state)


def preference_example(model):
    """Two pairs as `preference._example` builds them: left-padded prompts of 6 slots, right-padded answers of 5."""
    rng = np.random.default_rng(2)
    ids = {k: rng.integers(3, VOCAB, (2, w)).astype(np.int32) for k, w in
           (("prompt_ids", 6), ("chosen_ids", 5), ("rejected_ids", 5))}
    masks = {"prompt_mask": np.ones((2, 6), np.int32), "chosen_mask": np.ones((2, 5), np.int32),
             "rejected_mask": np.ones((2, 5), np.int32)}
    masks["prompt_mask"][1, :3] = 0
    masks["chosen_mask"][0, 2:] = masks["rejected_mask"][1, 4:] = 0
    return preference._example(model, {k: jnp.asarray(v) for k, v in {**ids, **masks}.items()})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2-final-softcap", "llama-untied", "qwen3-tied"])
def test_preference_log_probs_and_gradients_equal_tunixs(name):
    model = tiny_model(name)
    example = preference_example(model)

    def tunix(m):
        return dpo_trainer.compute_logps(m, example.input_ids, example.positions, example.attention_mask,
                                         example.logits_to_keep, example.completion_mask)

    def ours(m):
        return preference.reference_logps(m, example)

    def score(fn):  # a DPO-like scalar: the rows' log-probs weigh differently
        return lambda m: jnp.sum(jnp.log(jax.nn.sigmoid(fn(m)[0] - 0.5 * fn(m)[1])))

    expected, expected_grad = nnx.value_and_grad(score(tunix))(model)
    got, grad = nnx.value_and_grad(score(ours))(model)
    for a, b in zip(ours(model), tunix(model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(got), float(expected), atol=1e-5, rtol=0)
    assert_gradients_close(grad, expected_grad)
