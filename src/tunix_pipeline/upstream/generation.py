"""Where we reach into Tunix's sampler: its prefill and token choice (`docs/upstream_tunix.md`, "The sampler: ..."),
for evaluation, preference pairs, GRPO's rollouts, the harness and the judge."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.generate import utils as sampler_utils

from tunix_pipeline.runtime import without_batch_axes
from tunix_pipeline.sampling import sample_inverse_cdf


# ---------------------------------------------------------------- generation: the sampler's prefill and token choice
class Sampler(sampler_lib.Sampler):
    """Tunix's KV-cache `Sampler` (its decode loop: on device, stops when every row has ended) with our prefill:

    - the output layer runs at each prompt's last position only: the prompt but its last token goes into the
      KV cache and the last token is a decode step, so the prefill holds (batch, vocabulary) logits, not
      (batch, prompt, vocabulary): 8.6 GB in float32 for 8 prompts of 1,024 tokens over Gemma's 262k words;
    - `group_size` consecutive copies of one prompt (GRPO's G completions, pairs' and evaluation's k samples)
      are prefilled once and their cache copied to the group, when the batch is made of such groups.

    `next_token_logprobs` runs that prefill alone and reads chosen words' log-probabilities (a judge's labels).
    Prompts may also be token ids (lists), used as they are. The sampler reads the model's variables at each call,
    so a checkpoint restored into the same model afterwards is what the next call generates with.
    Text only: images, echo and beam search take Tunix's own prefill.

    `gather_weights`: each call first copies the weights whole onto every data-parallel device (one all-gather
    a call), so the decode loop runs without collectives; over fsdp-sharded weights, XLA otherwise gathers every
    layer at every decode step (the whole model over the interconnect per token).
    """

    def __init__(self, transformer, tokenizer, cache_config, group_size: int = 1, gather_weights: bool = False):
        super().__init__(transformer=transformer, tokenizer=tokenizer, cache_config=cache_config)
        self.group_size, self.gather_weights = group_size, gather_weights
        jit = functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("echo",))
        self._prefills = {g: jit(functools.partial(self._last_token_prefill, group=g)) for g in {1, group_size}}
        self._label_logprobs = jax.jit(self._next_token_logprobs)

    @classmethod
    def for_model(cls, model, tokenizer, cache_size: int, group_size: int = 1, gather_weights: bool = False) -> Sampler:
        """Over `model`, with a KV cache of `cache_size` positions (prompt + new tokens)."""
        cfg = model.config
        return cls(model, tokenizer, sampler_lib.CacheConfig(cache_size=cache_size, num_layers=cfg.num_layers,
                                                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim),
                   group_size=group_size, gather_weights=gather_weights)

    @contextlib.contextmanager
    def _weights_for_call(self):
        """Within: the weights this call reads (gathered onto each data-parallel device with `gather_weights`)."""
        if not self.gather_weights:
            yield
            return
        sharded = self._flattened_transformer_state  # Tunix's calls read this attribute
        self._flattened_transformer_state = jax.tree.map(without_batch_axes, sharded)
        try:
            yield
        finally:
            self._flattened_transformer_state = sharded

    def tokenize(self, prompt):
        return super().tokenize(prompt) if isinstance(prompt, str) else np.asarray(prompt, dtype=np.int32)

    def __call__(self, input_strings, *args, **kwargs):
        tokens = [self.tokenize(x) for x in ([input_strings] if isinstance(input_strings, str) else input_strings)]
        self._compiled_prefill_fn = self._prefills[self.group_size if in_groups(tokens, self.group_size) else 1]
        with self._weights_for_call():
            return super().__call__(tokens, *args, **kwargs)

    def next_token_logprobs(self, prompts, prompt_length: int, token_ids) -> np.ndarray:
        """(prompts, len(`token_ids`)) log-probabilities of `token_ids` as each prompt's next token: the prefill
        alone, no decoding (a judge's label words). Prompts (text or token ids) are left-padded to `prompt_length`,
        which they must fit: one compile per length."""
        tokens = [self.tokenize(x) for x in prompts]
        padded = np.array([sampler_utils.pad_to_length(t, target_length=prompt_length, pad_value=self.tokenizer.pad_id(),
                                                       left=True) for t in tokens])
        state = self.init_sample_state(jnp.asarray(padded), total_sampling_steps=prompt_length + 1, include_logits=False,
                                       forbidden_token_ids=None, temperature=0.0, top_p=None, top_k=None,
                                       seed=jax.random.PRNGKey(0), beam_size=None)
        with self._weights_for_call():
            return np.asarray(self._label_logprobs(self._flattened_transformer_state, state, jnp.asarray(token_ids)))

    def _next_token_logprobs(self, params, sampler_state, token_ids):
        logits, _ = self._prefill_logits(params, sampler_state, group=1)
        return jnp.take(jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1), token_ids, axis=-1)

    def _prefill_logits(self, params, sampler_state, group: int):
        """(the last prompt position's logits, one row per group of `group` copies; the cache holding each group's
        prompt): the prompt but its last token fills the cache, the last token is a decode step."""
        batch = sampler_state.token_buffer.shape[0]
        length = int(np.asarray(sampler_state.num_input_tokens))  # static: the padded prompt length

        def firsts(x):  # one row per group
            return x[::group] if getattr(x, "ndim", 0) and x.shape[0] == batch else x

        tokens = sampler_state.token_buffer[::group, :length]
        positions = sampler_state.positions[::group, :length]
        mask = sampler_utils.make_causal_attn_mask(tokens != self.tokenizer.pad_id(), self.cache_config.cache_size)
        model = nnx.merge(self._transformer_graphdef, params)
        cache = jax.tree.map(firsts, sampler_state.cache)
        if length > 1:
            _, cache = model(tokens[:, :-1], positions[:, :-1], cache, mask[:, :-1])
        return model(tokens[:, -1:], positions[:, -1:], cache, mask[:, -1:])

    def _last_token_prefill(self, params, sampler_state, images=None, echo: bool = False, *, group: int):
        if images is not None or echo or sampler_state.sampling_mode == "beam_search":
            return self._prefill_fn(params, sampler_state, images, echo)
        length = int(np.asarray(sampler_state.num_input_tokens))
        logits, cache = self._prefill_logits(params, sampler_state, group)
        if group > 1:
            logits = jnp.repeat(logits, group, axis=0)
            cache = jax.tree.map(lambda x: jnp.repeat(x, group, axis=0) if getattr(x, "ndim", 0) else x, cache)
        logits_buffer = sampler_state.logits_buffer
        if logits_buffer is not None:
            logits_buffer = jax.lax.dynamic_update_slice(logits_buffer, logits.astype(logits_buffer.dtype), (0, length, 0))
        state = dataclasses.replace(sampler_state, cache=cache, logits_buffer=logits_buffer)
        return self._sample(logits=logits, cache=cache, eos=self.eos_ids, sampler_state=state)

    def _sample(self, logits, eos, cache, sampler_state):
        """Tunix's token choice and bookkeeping, with cheaper exact choices over the whole vocabulary: greedy by
        `top_k(1)` (XLA:CPU's argmax over 262k words is ~5x slower) and plain temperature sampling by the inverse
        CDF (`sample_inverse_cdf`); top-k, top-p < 1 and beam search take Tunix's."""
        mode, settings = sampler_state.sampling_mode, sampler_state.sampling_parameters
        if not (mode == "greedy" or (mode == "top_p" and settings["top_p"] >= 1.0 and not settings["top_k"])):
            return super()._sample(logits=logits, eos=eos, cache=cache, sampler_state=sampler_state)
        step = sampler_state.decoding_step
        last = logits[:, -1].astype(jnp.float32)
        if sampler_state.forbidden_token_ids:
            last = last.at[:, sampler_state.forbidden_token_ids].set(-jnp.inf)
        if mode == "greedy":
            token = jax.lax.top_k(last, 1)[1][:, 0]
        else:
            last = last / sampler_state.temperature
            token = sample_inverse_cdf(jax.random.fold_in(sampler_state.seed, step), last)
        logprobs = sampler_state.logprobs_buffer
        if logprobs is not None:
            chosen = jnp.take_along_axis(jax.nn.log_softmax(last, axis=-1), token[:, None], axis=-1)[:, 0]
            logprobs = logprobs.at[:, step + 1].set(chosen)
        return dataclasses.replace(
            sampler_state, decoding_step=step + 1, token_buffer=sampler_state.token_buffer.at[:, step + 1].set(token),
            logprobs_buffer=logprobs, cache=cache, done=sampler_state.done | jnp.isin(token, eos),
        )


def in_groups(tokens: list, group_size: int) -> bool:
    """Is the batch made of runs of `group_size` identical prompts?"""
    if group_size <= 1 or len(tokens) % group_size:
        return False
    return all(np.array_equal(tokens[i], tokens[i - i % group_size]) for i in range(len(tokens)))


def grouped_rollout():
    """Tunix's vanilla rollout over our `Sampler`, for `ClusterConfig.rollout_engine` (with `group_size` bound):
    Tunix's GRPO learner asks for a prompt's G completions as G copies in a row, which `Sampler` prefills once;
    `gather_weights`: `Sampler`'s."""
    from tunix.rl.rollout import vanilla_rollout

    class GroupedRollout(vanilla_rollout.VanillaRollout):
        def __init__(self, rollout_actor, tokenizer, mesh, rollout_config, group_size: int, gather_weights: bool):
            del mesh  # the sampler runs where the actor's arrays are, as Tunix's vanilla rollout does
            self._sampler = Sampler.for_model(rollout_actor, tokenizer, rollout_config.kv_cache_size, group_size,
                                              gather_weights)

    return GroupedRollout
