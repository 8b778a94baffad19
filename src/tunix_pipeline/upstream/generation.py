"""Where we reach into Tunix's sampler: its prefill and token choice (`docs/upstream_tunix.md`, "The sampler: ..."),
for evaluation, preference pairs, GRPO's rollouts, the harness and the judge; and its decode loop's state, for
continuous batching (`Sampler.generate_rows`; "The sampler's batch decodes until its slowest row ends")."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.generate import utils as sampler_utils
from tunix.rl.rollout import vanilla_rollout

from tunix_pipeline.core.runtime import step_compiler_options, without_batch_axes
from tunix_pipeline.upstream.jit_options import jit_with_options
from tunix_pipeline.upstream.rows import Rows, map_cache, prefill_length, repeating, stop_string_table
from tunix_pipeline.upstream.sampling import sample_inverse_cdf


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

    `generate_rows`: continuous batching over Tunix's decode state: each row stops at its own end (stop tokens,
    stop strings, its own length limit) and its slot takes the next prompt, so a batch never waits on its slowest row.

    `gather_weights`: each call first copies the weights whole onto every data-parallel device (one all-gather
    a call), so the decode loop runs without collectives; over fsdp-sharded weights, XLA otherwise gathers every
    layer at every decode step (the whole model over the interconnect per token).
    """

    def __init__(self, transformer, tokenizer, cache_config, group_size: int = 1, gather_weights: bool = False):
        # XLA:CPU's default fusion updates each layer's KV cache twice in a decode step (once for the attention
        # that reads it, once for the loop's state) and so copies each layer's keys and values four times a step;
        # the train step's dot fusion keeps one update in place (benchmarks/RESULTS.md, section 38)
        with jit_with_options(step_compiler_options()):
            super().__init__(transformer=transformer, tokenizer=tokenizer, cache_config=cache_config)
            jit = functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("echo",))
            self._prefills = {g: jit(functools.partial(self._last_token_prefill, group=g)) for g in {1, group_size}}
            self._label_logprobs = jax.jit(self._next_token_logprobs)
            rows = functools.partial(jax.jit, static_argnames=("max_new", "repeats"))
            self._decode_rows = rows(self._decode_rows_fn, donate_argnums=(1,))
            self._admit_rows = rows(self._admit_rows_fn, donate_argnums=(0,))
            self._shift_rows = jax.jit(self._shift_rows_fn, donate_argnums=(0,))
            self._take_rows = jax.jit(lambda x, keep: x[keep])
        self.group_size, self.gather_weights = group_size, gather_weights
        self._stop_tables: dict[tuple[str, ...], tuple] = {}

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

    def init_sample_state(self, *args, **kwargs):
        # Tunix keeps the padded prompt length, a static (metadata) field of its state, as a jax array. Jit caches
        # keyed on the state's structure then compare arrays, and such a comparison made while another function is
        # traced (a cache entry dropped then) is a traced boolean and fails; a Python int compares plainly.
        state = super().init_sample_state(*args, **kwargs)
        return dataclasses.replace(state, num_input_tokens=int(state.num_input_tokens))

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
        length = sampler_state.num_input_tokens  # static: the padded prompt length

        def firsts(x):  # one row per group
            return x[::group] if getattr(x, "ndim", 0) and x.shape[0] == batch else x

        tokens = sampler_state.token_buffer[::group, :length]
        positions = sampler_state.positions[::group, :length]
        # over the cache's own positions (a refill's prompts are prefilled in a cache as long as they are)
        width = max(x.shape[1] for x in jax.tree.leaves(sampler_state.cache) if x.ndim > 1)
        mask = sampler_utils.make_causal_attn_mask(tokens != self.tokenizer.pad_id(), width)
        model = nnx.merge(self._transformer_graphdef, params)
        cache = jax.tree.map(firsts, sampler_state.cache)
        if length > 1:
            _, cache = model(tokens[:, :-1], positions[:, :-1], cache, mask[:, :-1])
        return model(tokens[:, -1:], positions[:, -1:], cache, mask[:, -1:])

    def _last_token_prefill(self, params, sampler_state, images=None, echo: bool = False, *, group: int):
        if images is not None or echo or sampler_state.sampling_mode == "beam_search":
            return self._prefill_fn(params, sampler_state, images, echo)
        length = sampler_state.num_input_tokens
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

    # ------------------------------------------------------------ continuous batching
    def generate_rows(self, prompts, *, batch_size: int, max_prompt_length: int, max_generation_steps: int, eos_tokens,
                      stop_strings: tuple[str, ...] = (), refill: int | None = None, temperature: float = 0.0,
                      top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                      repeats: int | None = None, progress: Callable[[int, int], None] | None = None,
                      on_row: Callable[[int, np.ndarray], None] | None = None) -> list[np.ndarray]:
        """Each prompt's completion tokens, in order, by continuous batching over `batch_size` slots: a row ends at
        one of `eos_tokens` (not kept), at the end of one of `stop_strings` (kept), once a block of `repeats` to
        2 x `repeats` - 1 of its tokens has come twice back to back (kept; `rows.repeating`; None: never) or after
        `max_generation_steps` tokens, and its slot takes the next prompt (`refill` at a time); `progress(rows
        finished, their tokens)`; `on_row(prompt index, its tokens)` as each row ends.
        How, and what it compiles: docs/upstream_tunix.md, "The sampler's batch decodes until its slowest row ends"."""
        tokens = [self.tokenize(x) for x in prompts]
        if not tokens:
            return []
        B, P, N, C = batch_size, max_prompt_length, max_generation_steps, self.cache_config.cache_size
        lengths = np.array([len(t) for t in tokens])
        _check_fits(int(lengths.max()), P, N, C)
        R = max(1, min(refill or B // 4, B))
        smallest = min(B, 4)  # the batch a draining call shrinks to (each halving compiles the decode loop once)
        order = np.argsort(lengths, kind="stable")  # similar lengths share a prefill; groups stay together
        pad = self.tokenizer.pad_id()
        key = jax.random.PRNGKey(seed or 0)
        eos = jnp.asarray(list(eos_tokens) or [self.tokenizer.eos_id()], jnp.int32)
        self.eos_ids = eos  # what Tunix's step reads; our bookkeeping (`_finish`) decides which rows end
        tables = self._stop_table(tuple(stop_strings))

        fresh = functools.partial(self._fresh_state, key=key, sampling=(temperature, top_p, top_k))
        rows = self._empty_rows(fresh([[pad]] * B, P, C, C, 0, 0), P, len(tables))
        out: list[np.ndarray | None] = [None] * len(tokens)
        owner, first = np.full(B, -1), np.zeros(B, np.int64)  # each slot's prompt (-1: free) and first new token
        queued = finished = generated = refills = decodes = 0
        with self._weights_for_call():
            params = self._flattened_transformer_state
            while True:
                done, buffer, end, t = jax.device_get(
                    (rows.state.done, rows.state.token_buffer, rows.end, rows.state.decoding_step))
                t = int(t)
                for slot in np.flatnonzero(done & (owner >= 0)):
                    out[owner[slot]], finished = buffer[slot, first[slot] : end[slot]], finished + 1
                    generated += end[slot] - first[slot]
                    if on_row is not None:
                        on_row(int(owner[slot]), out[owner[slot]])
                    owner[slot] = -1
                if progress is not None:
                    progress(finished, generated)
                if t >= C - 1 and (owner >= 0).any():
                    raise RuntimeError("continuous batching ran past its cache")  # the invariants above prevent it
                free = list(np.flatnonzero(owner < 0))
                while queued < len(tokens) and len(free) >= min(R, len(tokens) - queued):
                    if t + N > C:  # the newcomers' tokens would not fit: move back by what precedes the oldest row
                        live = owner >= 0
                        behind = int(first[live].min()) - P if live.any() else t - P
                        rows, t, first = self._shift_rows(rows, jnp.int32(behind)), t - behind, first - behind
                    take = min(R, len(tokens) - queued)
                    picked = order[queued : queued + take]
                    chunk = [tokens[i] for i in picked] + [tokens[picked[-1]]] * (R - take)  # one shape
                    state = self._prefilled(params, chunk, P, lambda *a: fresh(*a, 1, refills))
                    slots = np.array(free[:take] + [B] * (R - take))  # B: out of range, dropped
                    rows = self._admit_rows(rows, state, jnp.asarray(slots, jnp.int32), eos, tables, max_new=N,
                                            repeats=repeats)
                    owner[slots[:take]], first[slots[:take]] = picked, t
                    queued, free, refills = queued + take, free[take:], refills + 1
                live = owner >= 0
                if not live.any():
                    return out
                if queued == len(tokens):  # draining: the batch halves while its unfinished rows fit in half
                    rows, owner, first, B = self._drained(rows, owner, first, B, smallest)
                    exit_at = B - B // 2 if B // 2 >= smallest else B
                else:
                    exit_at = min(R, len(tokens) - queued)
                state = dataclasses.replace(rows.state, seed=jax.random.fold_in(jax.random.fold_in(key, 2), decodes))
                rows = self._decode_rows(params, rows._replace(state=state), jnp.int32(exit_at), eos, tables, max_new=N,
                                         repeats=repeats)
                decodes += 1

    def _prefilled(self, params, chunk: list, limit: int, fresh):
        """`chunk`'s prompts prefilled at their bucketed length (`prefill_length`), once per group of identical ones;
        `fresh(rows, length, steps, cache)`: their state before."""
        length = prefill_length(max(len(c) for c in chunk), limit)
        prefill = self._prefills[self.group_size if in_groups(chunk, self.group_size) else 1]
        return prefill(params, fresh(chunk, length, length + 1, length), None, echo=False)

    def _drained(self, rows: Rows, owner, first, batch: int, smallest: int):
        """(rows, owner, first, batch) after halving the batch while its unfinished rows fit in half."""
        live = owner >= 0
        while batch // 2 >= smallest and live.sum() <= batch // 2:
            keep = np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])[: batch // 2]
            rows, owner, first = self._compact_rows(rows, jnp.asarray(keep)), owner[keep], first[keep]
            batch, live = batch // 2, owner >= 0
        return rows, owner, first, batch

    def _fresh_state(self, rows: list, length: int, steps: int, cache: int, stream: int, n: int, *, key, sampling):
        """Tunix's state for prompt rows left-padded to `length`, `steps` buffer positions, a cache of `cache`; its
        random stream `n` of `stream` from `key`; `sampling`: (temperature, top_p, top_k)."""
        temperature, top_p, top_k = sampling
        seed = jax.random.fold_in(jax.random.fold_in(key, stream), n)
        pad = self.tokenizer.pad_id()
        ids = np.array([sampler_utils.pad_to_length(np.asarray(r, np.int32), target_length=length, pad_value=pad,
                                                    left=True) for r in rows])
        kept = self.cache_config
        self.cache_config = dataclasses.replace(kept, cache_size=cache)  # what Tunix sizes the cache by
        try:
            return self.init_sample_state(
                jnp.asarray(ids), total_sampling_steps=steps, include_logits=False, forbidden_token_ids=None,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, beam_size=None)
        finally:
            self.cache_config = kept

    def _empty_rows(self, state, prompt_length: int, stops: int) -> Rows:
        """`batch` free slots (ended rows) at the decode step where the first prompts' new tokens start."""
        batch = state.token_buffer.shape[0]
        step = jnp.int32(prompt_length)
        state = dataclasses.replace(state, decoding_step=step, done=jnp.ones(batch, bool),
                                    cache=map_cache(lambda x: x, lambda x: jnp.full_like(x, step), state.cache))
        zeros = np.zeros(batch, np.int32)  # two buffers: the decode loop donates each
        return Rows(state, jnp.asarray(zeros), jnp.asarray(zeros), jnp.zeros((batch, stops), jnp.int32))

    def _finish(self, rows: Rows, before, eos, tables, max_new: int, repeats: int | None) -> Rows:
        """Which rows end with the token just chosen (at the decode step's index), and where their kept tokens end;
        `before`: the rows that had ended already."""
        state = rows.state
        step = state.decoding_step
        token = jax.lax.dynamic_index_in_dim(state.token_buffer, step, axis=1, keepdims=False)
        matched = rows.matched
        if tables:  # each stop string's characters matched so far, through the token's text
            matched = jnp.stack([table[token, jnp.minimum(matched[:, i], table.shape[1] - 1)].astype(jnp.int32)
                                 for i, table in enumerate(tables)], axis=1)
        whole = jnp.asarray([table.shape[1] for table in tables], jnp.int32)
        stopped = jnp.any(matched == whole, axis=1)
        at_eos = jnp.isin(token, eos)
        if repeats:
            stopped = stopped | repeating(state.token_buffer, step, rows.first, repeats)
        ends = ~before & (at_eos | stopped | (step - rows.first >= max_new - 1))
        end = jnp.where(ends, jnp.where(at_eos, step, step + 1), rows.end)
        return Rows(dataclasses.replace(state, done=before | ends), rows.first, end, matched)

    def _decode_rows_fn(self, params, rows: Rows, exit_at, eos, tables, *, max_new: int, repeats: int | None) -> Rows:
        """Tunix's decode step in a loop on the device, until `exit_at` slots hold ended rows."""
        last = rows.state.token_buffer.shape[1] - 1

        def step(rows):
            before = rows.state.done
            return self._finish(rows._replace(state=self._sample_step(params, rows.state)), before, eos, tables,
                                max_new, repeats)

        def more(rows):
            return (rows.state.decoding_step < last) & (jnp.sum(rows.state.done) < exit_at)

        return jax.lax.while_loop(more, step, rows)

    def _admit_rows_fn(self, rows: Rows, fresh, slots, eos, tables, *, max_new: int, repeats: int | None) -> Rows:
        """`fresh` (prefilled prompt rows in a cache as long as their prompt, their first token chosen) into `slots` of
        `rows`, placed along the buffers and cache so that their first new token sits at the shared decode step."""
        count, length = fresh.token_buffer.shape[0], fresh.token_buffer.shape[1] - 1
        new = self._finish(Rows(fresh, jnp.full(count, length, jnp.int32), jnp.zeros(count, jnp.int32),
                                jnp.zeros((count, rows.matched.shape[1]), jnp.int32)), jnp.zeros(count, bool), eos,
                           tables, max_new, repeats)
        state, step = rows.state, rows.state.decoding_step
        offset = step - length

        def place(old, rows_new, fill=0):  # the new rows along a slot array's positions, from `offset` on
            placed = jnp.full((count, *old.shape[1:]), fill, old.dtype)
            return jax.lax.dynamic_update_slice_in_dim(placed, rows_new.astype(old.dtype), offset, axis=1)

        def put(old, rows_new, fill=0):
            return old.at[slots].set(place(old, rows_new, fill), mode="drop")

        index = jnp.arange(state.positions.shape[1])
        positions = place(state.positions, new.state.positions)  # and on counting from the first new token's
        positions = jnp.where(index > step, new.state.positions[:, -1:] + index - step, positions)
        state = dataclasses.replace(
            state, token_buffer=put(state.token_buffer, new.state.token_buffer, self.tokenizer.pad_id()),
            positions=state.positions.at[slots].set(positions, mode="drop"),
            done=state.done.at[slots].set(new.state.done, mode="drop"),
            cache=map_cache(put, lambda old, _: jnp.full_like(old, step), state.cache, new.state.cache))

        def set_rows(old, values):
            return old.at[slots].set(values, mode="drop")

        return Rows(state, set_rows(rows.first, new.first + offset), set_rows(rows.end, new.end + offset),
                    set_rows(rows.matched, new.matched))

    def _shift_rows_fn(self, rows: Rows, by) -> Rows:
        """Every slot moved `by` positions back along the buffers and cache (what precedes the oldest unfinished row
        goes; it wraps round to positions the decode loop writes before it reads them)."""
        state = rows.state
        index = jnp.arange(state.token_buffer.shape[1])

        def back(x):
            return jnp.roll(x, -by, axis=1)

        first = rows.first - by
        # positions go on counting from each row's first new token (the wrapped part held the prompt's padding)
        positions = back(state.positions)
        start = jnp.take_along_axis(positions, jnp.clip(first, 0, index[-1])[:, None], axis=1)
        positions = jnp.where(index >= first[:, None], start + index - first[:, None], positions)
        state = dataclasses.replace(state, token_buffer=back(state.token_buffer), positions=positions,
                                    cache=map_cache(back, lambda x: x - by, state.cache),
                                    decoding_step=state.decoding_step - by)
        return Rows(state, first, rows.end - by, rows.matched)

    def _compact_rows(self, rows: Rows, keep) -> Rows:
        """The slots `keep` (in that order) alone: a smaller batch. The cache is taken a layer's buffer at a time,
        each old buffer freed once its copy is made, so the cache is never held at both sizes (whole, the first
        halving held 1.5 caches: the peak of a 3-shot evaluation, benchmarks/RESULTS.md section 50)."""
        def take(x):
            return self._take_rows(x, keep)

        def take_freeing(x):
            taken = jax.block_until_ready(take(x))  # the copy made before its source goes
            x.delete()
            return taken

        state = rows.state
        state = dataclasses.replace(state, token_buffer=take(state.token_buffer), positions=take(state.positions),
                                    done=take(state.done), cache=jax.tree.map(take_freeing, state.cache))
        return Rows(state, take(rows.first), take(rows.end), take(rows.matched))

    def _stop_table(self, stop_strings: tuple[str, ...]) -> tuple:
        """Each stop string's `stop_string_table` over this vocabulary, on the device (built once per tuple)."""
        if stop_strings not in self._stop_tables:
            tokenizer = self.tokenizer.tokenizer
            size = max(len(tokenizer), getattr(self.transformer, "num_embed", 0) or 0)
            ids = [[i] for i in range(len(tokenizer))]
            decode = getattr(tokenizer, "batch_decode", None)
            texts = decode(ids) if decode else [self.tokenizer.decode(i) for i in ids]
            texts += [""] * (size - len(texts))  # ids past the tokenizer's (a padded output layer) spell nothing
            self._stop_tables[stop_strings] = tuple(jnp.asarray(stop_string_table(texts, s)) for s in stop_strings)
        return self._stop_tables[stop_strings]


def _check_fits(longest: int, prompt_length: int, new_tokens: int, cache: int) -> None:
    if longest > prompt_length:
        raise ValueError(f"a prompt of {longest} tokens is longer than max_prompt_length={prompt_length}")
    if cache < prompt_length + 2 * new_tokens:
        raise ValueError(f"continuous batching needs a cache of max_prompt_length + 2 x max_generation_steps = "
                         f"{prompt_length + 2 * new_tokens} positions; this sampler's holds {cache}")


def in_groups(tokens: list, group_size: int) -> bool:
    """Is the batch made of runs of `group_size` identical prompts?"""
    if group_size <= 1 or len(tokens) % group_size:
        return False
    return all(np.array_equal(tokens[i], tokens[i - i % group_size]) for i in range(len(tokens)))


def grouped_rollout():
    """Tunix's vanilla rollout over our `Sampler`, for `ClusterConfig.rollout_engine` (with `group_size` bound):
    Tunix's GRPO learner asks for a prompt's G completions as G copies in a row, which `Sampler` prefills once;
    `gather_weights`: `Sampler`'s."""
    class GroupedRollout(vanilla_rollout.VanillaRollout):
        def __init__(self, rollout_actor, tokenizer, mesh, rollout_config, group_size: int, gather_weights: bool):
            del mesh  # the sampler runs where the actor's arrays are, as Tunix's vanilla rollout does
            self._sampler = Sampler.for_model(rollout_actor, tokenizer, rollout_config.kv_cache_size, group_size,
                                              gather_weights)

    return GroupedRollout
