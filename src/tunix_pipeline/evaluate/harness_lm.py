"""`JaxLM`: our JAX model (as loaded, on its mesh) behind lm-evaluation-harness's `LM` interface; imported only
where lm-eval is installed (`harness.make_lm`). What it does and why: `harness`'s docstring."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as lm_utils
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tunix.sft import utils as sft_utils

from tunix_pipeline.core.errors import HarnessError
from tunix_pipeline.generate.generation import make_sampler, next_power_of_two, sampling_args

MIN_BUCKET = 16  # shortest padded length: fewer tiny buckets, each one a compile


class JaxLM(TemplateLM):
    """Our JAX model (as loaded, on its mesh) behind lm-eval's `LM` interface."""

    backend = "causal"

    def __init__(self, model, tokenizer, mesh, batch_size: int, max_length: int, seed: int = 0,
                 eos_ids: list[int] = ()):
        super().__init__()
        self.model, self.tokenizer, self.mesh = model, tokenizer, mesh
        self.eos_ids = set(eos_ids) | {tokenizer.eos_token_id}  # where `hf` (generate) stops a row
        self.batch_size, self._max_length, self.seed = batch_size, max_length, seed
        self.max_gen_toks = 256  # lm-eval's HF default, when a task names none
        self._samplers: dict[int, object] = {}

    # -- what TemplateLM needs to tokenize like `hf`
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and lm_utils.has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -- log-likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]  # as `hf`: cut on the left
            rows.append((whole, len(continuation)))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            logprobs, greedy = self._score([rows[i][0] for i in chosen])
            for j, i in enumerate(chosen):
                n_input, n_cont = len(rows[i][0]) - 1, rows[i][1]
                span = slice(n_input - n_cont, n_input)
                out[i] = (float(np.sum(logprobs[j, span], dtype=np.float64)), bool(np.all(greedy[j, span])))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def _score(self, sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Per position: log p(next token) and whether it is the argmax, for a padded batch."""
        length = min(max(MIN_BUCKET, next_power_of_two(max(len(s) - 1 for s in sequences))), self.max_length)
        tokens = np.zeros((self.batch_size, length), np.int32)
        targets = np.zeros_like(tokens)
        mask = np.zeros_like(tokens)
        for j, s in enumerate(sequences):
            tokens[j, : len(s) - 1], targets[j, : len(s) - 1], mask[j, : len(s) - 1] = s[:-1], s[1:], 1
        mask[len(sequences):, 0] = 1  # filler rows: one token, so no row is all padding
        with self.mesh:
            logprobs, greedy = _logprobs_fn()(self.model, tokens, mask, targets)
        return np.asarray(logprobs), np.asarray(greedy)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one sampling set-up per batch
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos = self.tokenizer.decode([self.eot_token_id])
        for indices in groups.values():
            kwargs = lm_utils.normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = lm_utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            sampling = sampling_args(
                float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                kwargs.get("top_p"), kwargs.get("top_k"),
            )
            if max_new >= self.max_length:
                raise HarnessError(f"max_gen_toks {max_new} leaves no room for a prompt in max_length "
                                   f"{self.max_length}; lower evaluate.harness.max_gen_toks or raise max_length")
            # as `hf`: the context keeps its last max_length - max_new tokens
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for n, start in enumerate(range(0, len(order), self.batch_size)):
                chosen = order[start : start + self.batch_size]
                texts = self._generate([prompts[i] for i in chosen], max_new, until, sampling, self.seed + n)
                for i, text in zip(chosen, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _stop_ids(self, until: list[str]) -> list[int]:
        """A row ends where `hf`'s would: the model's EOS ids, or a stop string that is one special token."""
        vocab = self.tokenizer.get_vocab()
        special = set(self.tokenizer.all_special_tokens) | set(getattr(self.tokenizer, "added_tokens_encoder", {}))
        return sorted(self.eos_ids | {vocab[s] for s in until if s in special and s in vocab})

    def _generate(self, prompts, max_new: int, until: list[str], sampling: dict, seed: int) -> list[str]:
        length = max(MIN_BUCKET, next_power_of_two(max(len(p) for p in prompts)))
        cache = length + max_new
        if cache not in self._samplers:
            self._samplers[cache] = make_sampler(self.model, self.tokenizer, cache)
        padded = prompts + [prompts[-1]] * (self.batch_size - len(prompts))  # one shape per bucket
        with self.mesh:
            result = self._samplers[cache](
                padded, max_generation_steps=max_new, max_prompt_length=length,
                eos_tokens=self._stop_ids(until), seed=seed if sampling else None, **sampling,
            )
        texts = [self.tok_decode(np.asarray(t).tolist()) for t in result.tokens[: len(prompts)]]
        return [lm_utils.postprocess_generated_text(t, until, None) for t in texts]


@functools.cache
def _logprobs_fn():
    """log p(target) and argmax == target at each position: the (B, L, V) log-softmax never leaves the device."""
    @nnx.jit
    def logprobs(model, tokens, mask, targets):
        mask = mask.astype(bool)
        logits, _ = model(tokens, sft_utils.build_positions_from_mask(mask), None, sft_utils.make_causal_attn_mask(mask))
        logits = logits.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets

    return logprobs
