"""Generation with Tunix's KV-cache sampler, for evaluation, preference pairs, GRPO's rollouts and the harness.

- `end_tokens`: the token ids a generation stops at (EOS and, where the vocabulary has them, Gemma's end of turn and,
  for evaluation and pairs, start of turn: a model that opens a new turn has closed its own);
- `prompt_lengths`: prompts counted in tokens as the sampler counts them, so a length limit means what it says;
- `make_sampler` / `sampling_args` / `Generator`: the sampler (`upstream.Sampler`), its arguments, and continuous
  batching over it (each row stops at its own end, or once it repeats itself: `evaluate.stop_repeats`, and its
  slot takes the next prompt);
- `KeptRows`: greedy rows written to a file as each ends, so that a generation stopped part-way goes on from them;
- `scored_split`: the eval rows models are scored on (the test split when there is one);
- `fitting_prompts` / `select_prompts`: the prompts that fit a stage's `max_prompt_length` (the rest skipped,
  counted and logged under that stage's setting), and the prompt length the sampler's cache is sized for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import jax
import numpy as np
import pandas as pd
from flax import nnx
from tunix.generate import tokenizer_adapter

from tunix_pipeline.config import EvaluateParams
from tunix_pipeline.core.progress import Progress
from tunix_pipeline.core.runtime import split_over_batch
from tunix_pipeline.data.answers import GEMMA_END_OF_TURN, TAGS
from tunix_pipeline.upstream import Sampler
from tunix_pipeline.upstream.rows import ends_repeating

log = logging.getLogger(__name__)

GEMMA_START_OF_TURN = "<start_of_turn>"


def end_tokens(tokenizer, new_turn: bool = False) -> list[int]:
    """EOS and, where the vocabulary has it, Gemma's end of turn; with `new_turn`, also its start of turn (a model that
    opens a new turn has closed its own: a base model that never closes its turn goes on to write the next one).
    Evaluation and pairs (`Generator`) stop at all three; GRPO's rollouts at the first two (a rollout stopped at its
    first token is empty, and Tunix's loss leaves empty rows out of each micro-batch's mean)."""
    stop = [tokenizer.eos_token_id]
    vocab = tokenizer.get_vocab()
    stop += [tokenizer.convert_tokens_to_ids(t) for t in (GEMMA_END_OF_TURN, GEMMA_START_OF_TURN)[: 1 + new_turn]
             if t in vocab]
    return [t for t in stop if t is not None]


def prompt_lengths(tokenizer, prompts: list[str]) -> list[int]:
    """Prompt lengths in tokens, counted as Tunix's sampler tokenizes them (one BOS)."""
    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer)
    bos = [adapter.bos_id()] if adapter.bos_id() is not None else []
    return [len(adapter.dedup_bos_ids(bos + list(adapter.encode(p)))) for p in prompts]


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def make_sampler(model, tokenizer, cache_size: int, group_size: int = 1, gather_weights: bool = False):
    """Our sampler (`upstream.Sampler`: Tunix's with our prefill and token choice) over `model` with a KV cache of
    `cache_size` positions (prompt + new tokens), prefilling groups of `group_size` identical prompts once;
    `gather_weights`: `Sampler`'s."""
    return Sampler.for_model(model, tokenizer, cache_size, group_size, gather_weights=gather_weights)


def gathers_weights(weights: str, model) -> bool:
    """Will each generation call copy `model`'s weights whole onto every data-parallel device first
    (`runtime.decode_weights`: "gathered") or leave them split as trained ("sharded", or "gathered" where the whole
    copy would take over half a device's free memory: logged)? Nothing to gather where no weight is split over
    data-parallel devices."""
    leaves = jax.tree.leaves(nnx.state(model))
    split = [x for x in leaves if split_over_batch(x)]
    if weights != "gathered" or not split:
        return False
    stats = split[0].devices().pop().memory_stats()  # None on a CPU
    whole = sum(x.nbytes for x in leaves) / split[0].sharding.mesh.shape.get("tp", 1)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if stats and "bytes_limit" in stats else None
    if free is not None and whole > free / 2:
        log.warning("runtime.decode_weights: gathered: the whole weights (%.2f GiB a device) would take over half of a "
                    "device's free %.2f GiB; decoding with them sharded instead", whole / 2**30, free / 2**30)
        return False
    return True


def sampling_args(temperature: float, top_p: float | None, top_k: int | None) -> dict:
    """The sampler's arguments: none is greedy (temperature 0), else top-p / top-k sampling."""
    if temperature <= 0:
        return {}
    return dict(temperature=temperature, top_p=top_p if top_p is not None else 1.0, top_k=top_k)


class Generator:
    """Continuous batching over our sampler (`upstream.Sampler.generate_rows`): `batch_size` slots; a row stops at
    `end_tokens` with a new turn (not kept), at the closing answer tag (kept: the scorer reads the closed tag; what
    follows is never generated) or at `max_new_tokens`, and its slot takes the next prompt, so no row waits for a
    looping one; a row that repeats a block back to back ends there (`evaluate.stop_repeats`; `repeated`: which rows
    of the last call did). `decode_weights`: `gathers_weights`'."""

    def __init__(self, model, tokenizer, params: EvaluateParams, prompt_length: int, decode_weights: str = "sharded",
                 stop_strings: tuple[str, ...] = (TAGS[3],)):
        self.params = params
        self.prompt_length = prompt_length
        self.stop = end_tokens(tokenizer, new_turn=True)
        self.stop_strings = tuple(stop_strings)
        self.repeated: list[bool] = []
        self.resumed = 0  # rows the last call took from `kept`
        # rows share one cache write index: the oldest row's prompt stays behind it, the newest row's tokens ahead
        cache = prompt_length + 2 * params.max_new_tokens
        self.sampler = make_sampler(model, tokenizer, cache, params.num_samples, gathers_weights(decode_weights, model))

    def __call__(self, prompts: list[str], kept: KeptRows | None = None,
                 seed: int | None = None) -> tuple[list[str], list[int]]:
        """(texts, completion lengths in tokens), `num_samples` consecutive ones per prompt; `kept` (greedy decoding
        only): the rows an earlier call wrote there are taken, the others generated and written there as each ends;
        `seed`: sampling's, in place of the settings' `seed` (a caller that samples its prompts in parts)."""
        p = self.params
        expanded = [prompt for prompt in prompts for _ in range(p.num_samples)]
        sampling = sampling_args(p.temperature, p.top_p, p.top_k)
        if sampling and kept is not None:
            raise ValueError("only greedy rows are kept: a sampled row depends on the rows decoded beside it")
        rows: list = [None] * len(expanded)
        if kept is not None:
            rows = kept.taken(expanded)
        todo = [i for i, r in enumerate(rows) if r is None]
        before = self.resumed = len(rows) - len(todo)
        if before:
            log.info("generate: %d of %d rows taken from %s (kept by an earlier run: one stopped part-way, or "
                     "another that scored this policy)", before, len(rows), kept.path)
        report = Progress("generate", len(rows), start=before, bar=True, unit="row")
        started = time.perf_counter()

        def progress(done: int, tokens: int) -> None:
            if done:
                report.update(before + done, tokens_per_sec=tokens / (time.perf_counter() - started))

        def on_row(j: int, tokens: np.ndarray) -> None:
            kept.write(expanded[todo[j]], tokens)

        # slots refill an eighth of the batch at a time (fewer idle slots, against more returns to the host), in
        # whole groups of samples (one prefill per group)
        refill = max(p.num_samples, p.batch_size // 8 // p.num_samples * p.num_samples)
        generated = self.sampler.generate_rows(
            [expanded[i] for i in todo], batch_size=p.batch_size, max_prompt_length=self.prompt_length,
            max_generation_steps=p.max_new_tokens, eos_tokens=self.stop, stop_strings=self.stop_strings, refill=refill,
            seed=(p.seed if seed is None else seed) if sampling else None, repeats=p.stop_repeats, progress=progress,
            on_row=on_row if kept is not None else None, **sampling,
        )
        report.close()
        for i, r in zip(todo, generated):
            rows[i] = r
        self.repeated = [bool(p.stop_repeats) and len(r) < p.max_new_tokens and ends_repeating(r, p.stop_repeats)
                         for r in rows]
        texts = [through_stop(self.sampler.tokenizer.decode(r.tolist()), self.stop_strings) for r in rows]
        return texts, [len(r) for r in rows]


def prompt_key(prompt: str) -> str:
    """A prompt's digest: what a file of rows or scores kept for later runs knows it by."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:24]


class KeptRows:
    """Greedy generations written to a JSON-lines file as each row ends (its prompt's digest, its tokens), so that a
    generation stopped part-way (Ctrl-C, a killed or preempted session) takes them on the next run and generates
    only the rest, as lm-eval's `--use_cache` does. The file belongs to one policy and its decoding settings (the
    caller names it so); a greedy row depends on its prompt alone. A line cut short by a kill, or a row whose tokens
    are not token ids, is generated again; a file that cannot be written stops keeping rows, with one warning, and the
    generation goes on."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._writable = True

    def taken(self, prompts: list[str]) -> list[np.ndarray | None]:
        """Each prompt's row as written before, or None."""
        try:
            text = self.path.read_text()
        except OSError:
            return [None] * len(prompts)
        known: dict[str, list[int]] = {}
        for line in text.splitlines():
            try:
                row = json.loads(line)
                prompt, tokens = row["prompt"], row["tokens"]
            except (ValueError, KeyError, TypeError):  # the line a kill cut short
                continue
            if isinstance(tokens, list) and all(type(t) is int for t in tokens):  # not a row edited by hand
                known[prompt] = tokens
        if text and not text.endswith("\n"):  # the next row starts a line of its own
            self._append("\n")
        rows = [known.get(prompt_key(p)) for p in prompts]
        return [None if r is None else np.asarray(r, np.int32) for r in rows]

    def write(self, prompt: str, tokens: np.ndarray) -> None:
        self._append(json.dumps({"prompt": prompt_key(prompt), "tokens": [int(t) for t in tokens]}) + "\n")

    def _append(self, text: str) -> None:
        if not self._writable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:  # a row at a time, on disk when it closes: a kill loses one at most
                f.write(text)
        except OSError as err:
            self._writable = False
            log.warning("generate: cannot write the rows to %s (%s); this generation goes on without keeping them",
                        self.path, err)


def through_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """`text` up to and including the first of `stop_strings` it holds (the token that completed it may spell more)."""
    cut = min((text.find(s) + len(s) for s in stop_strings if s in text), default=len(text))
    return text[:cut]


def fitting_prompts(
    formatted: pd.DataFrame, tokenizer, max_prompt_length: int, *, setting: str, lengths=None
) -> tuple[pd.DataFrame, int]:
    """(rows whose prompt fits `max_prompt_length` tokens, how many were skipped); the skipped are logged.

    `setting`: the config key that sets the limit, named in the warning (no default: each stage names its own);
    `lengths`: the prompts' token counts when the caller has them.
    """
    if not len(formatted):
        return formatted, 0
    lengths = np.asarray(prompt_lengths(tokenizer, formatted["prompt"].tolist()) if lengths is None else lengths)
    fits = lengths <= max_prompt_length
    skipped = int((~fits).sum())
    if skipped:
        log.warning("%s: %d of %d prompts are longer than %s=%d tokens (longest %d); skipped",
                    setting.split(".")[0], skipped, len(formatted), setting, max_prompt_length, int(lengths.max()))
    return formatted[fits].reset_index(drop=True), skipped


def scored_split(formatted: pd.DataFrame) -> pd.DataFrame:
    """The eval rows a model is scored on: the test rows (from evaluation-only sources) when there are any, else the
    dev rows (carved from the training sources)."""
    if "split" in formatted.columns and (formatted["split"] == "test").any():
        return formatted[formatted["split"] == "test"].reset_index(drop=True)
    return formatted


def select_prompts(formatted: pd.DataFrame, tokenizer, params: EvaluateParams) -> tuple[pd.DataFrame, int, int]:
    """(prompts to generate for: the first `num_prompts` of `scored_split`, how many were skipped as too long, the
    padded prompt length)."""
    held_out = scored_split(formatted).head(params.num_prompts).reset_index(drop=True)
    if not len(held_out):
        return held_out, 0, 0
    lengths = prompt_lengths(tokenizer, held_out["prompt"].tolist())
    if params.max_prompt_length is None:
        return held_out, 0, next_power_of_two(int(max(lengths)))
    rows, skipped = fitting_prompts(held_out, tokenizer, params.max_prompt_length,
                                    setting="evaluate.max_prompt_length", lengths=lengths)
    return rows, skipped, params.max_prompt_length
