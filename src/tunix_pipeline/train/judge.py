"""A judge model's scores for completions: the reward `fn: judge`, and evaluation's `judge_score`.

The judge is any model `model.source` can name (a hub id, a local folder, a .gguf file, `pypi:`), loaded on first
use onto the policy's devices (time-shared) or onto its own sub-mesh (`judge.devices`: the last N devices; the
policy keeps the rest, `meshes`). Each completion's rubric (`JudgeParams.rubric`: the question, the completion,
the reference) is rendered as the judge's user turn, and its score read from the judge's reply:

- `read: label`: the probability of each label word as the reply's first token, from the prefill alone
  (`upstream.Sampler.next_token_logprobs`), renormalised over the labels; the score is their weighted mean;
- `read: number`: a greedy reply of up to `max_new_tokens` from the same sampler; its first number, in
  `score_range`, mapped to [0, 1].

All of a call's rubrics are scored in padded batches of `batch_size` at a few bucketed lengths (one compile each).
A reply with no number in range, or a rubric longer than `max_prompt_length`, scores `malformed_score` and is
counted: a judge never fails a step.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import jax
import numpy as np

from tunix_pipeline.config import FormatParams, JudgeParams, ModelParams, RewardParams, RuntimeParams
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.data.answers import GEMMA_END_OF_TURN, clean
from tunix_pipeline.data.formatting import render_prompt
from tunix_pipeline.generate.generation import end_tokens, make_sampler, prompt_lengths
from tunix_pipeline.models.hub import check_source, load_tokenizer, resolve_model_dir
from tunix_pipeline.models.loading import load_model

log = logging.getLogger(__name__)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
NO_REFERENCE = "(none)"
SMALLEST_BUCKET = 64  # shorter rubrics share this compiled length


class JudgeError(UserError, ValueError):
    """A judge that cannot score as configured (labels its vocabulary cannot tell apart, devices it cannot have)."""


@dataclasses.dataclass
class JudgeScores:
    """One scoring call: a score in [0, 1] per completion, how many were malformed, its wall time; for
    `read: label` the mean probability the judge put on the label words (low: it does not follow the rubric)."""

    values: np.ndarray
    malformed: int
    seconds: float
    label_mass: float | None = None


def question(prompt: str) -> str:
    """The user's text of a rendered prompt (Gemma's turns: its last user turn); other prompts as they are."""
    _, marker, turn = prompt.rpartition("<start_of_turn>user\n")
    return turn.split(GEMMA_END_OF_TURN, 1)[0].strip() if marker else prompt.strip()


def label_token_ids(tokenizer, labels: dict[str, float]) -> list[list[int]]:
    """Each label's first-token ids, over its spellings (`Yes`, `yes`, ` Yes`, ...): a label is as likely as all of
    them together. Labels whose spellings share a first token cannot be told apart: a `JudgeError`."""
    ids, seen = [], {}
    for label in labels:
        variants = {label, label.lower(), label.capitalize(), " " + label, " " + label.lower(), " " + label.capitalize()}
        firsts = {tokenizer.encode(v, add_special_tokens=False)[0] for v in variants}
        firsts = {t for t in firsts if tokenizer.decode([t]).strip()}  # a lone space starts every spaced label
        if not firsts:
            raise JudgeError(f"judge label {label!r} has no first token of its own in the judge's vocabulary")
        for token in firsts:
            if seen.setdefault(token, label) != label:
                raise JudgeError(f"judge labels {seen[token]!r} and {label!r} start with the same token "
                                 f"({tokenizer.convert_ids_to_tokens(token)!r}); choose labels that differ in their first word")
        ids.append(sorted(firsts))
    return ids


def read_number(reply: str, score_range: tuple[float, float]) -> float | None:
    """The reply's first number mapped from `score_range` to [0, 1]; None when there is none, or it is outside."""
    found = NUMBER.search(reply)
    if found is None:
        return None
    low, high = score_range
    value = float(found.group())
    return (value - low) / (high - low) if low <= value <= high else None


def meshes(runtime: RuntimeParams, rewards: list[RewardParams]):
    """(the policy's mesh, the judges' sub-mesh or None): with `judge.devices: N` the judges take the last N
    devices (all on fsdp) and the policy the rest, keeping `runtime.mesh`'s tp where it divides them (else 1) and
    giving fsdp what remains;
    without, both use all of them."""
    asked = {r.judge.devices for r in rewards if r.judge is not None and r.judge.devices}
    if not asked:
        return make_mesh(runtime), None
    if len(asked) > 1:
        raise JudgeError(f"judges ask for sub-meshes of {sorted(asked)} devices; give every judge the same `devices`")
    n, devices = asked.pop(), jax.devices()
    if n >= len(devices):
        raise JudgeError(f"judge.devices={n} leaves the policy none of the {len(devices)} devices; "
                         f"use fewer (at most {len(devices) - 1}), or null to share them")
    tp = 1 if runtime.mesh == "auto" else runtime.mesh.get("tp", 1)
    if (len(devices) - n) % tp:  # as the plan sizes it
        log.warning("judge.devices=%d leaves the policy %d devices, which runtime.mesh's tp=%d does not divide: "
                    "the policy runs with tp=1", n, len(devices) - n, tp)
        tp = 1
    policy = RuntimeParams(mesh={"fsdp": (len(devices) - n) // tp, "tp": tp})
    return make_mesh(policy, devices[:-n]), make_mesh(RuntimeParams(mesh="auto"), devices[-n:])


class Judge:
    """A judge model with its rubric; `score` (prompts, completions, references) -> `JudgeScores`; calling it is
    a reward function (`reference` from the dataset's columns). The model loads on the first call."""

    def __init__(self, params: JudgeParams, mesh=None):
        check_source(params.source, key="judge.source")  # a misspelt folder fails now, not at the first GRPO step
        self.params, self.mesh = params, mesh
        self.sampler = self.tokenizer = self.labels = None
        self.last: JudgeScores | None = None

    def __call__(self, prompts, completions, reference=None, **_) -> list[float]:
        references = [None] * len(completions) if reference is None else list(reference)
        self.last = self.score(list(prompts), list(completions), references)
        return self.last.values.tolist()

    def load(self) -> None:
        p = self.params
        folder = resolve_model_dir(ModelParams(source=p.source, revision=p.revision, dtype=p.dtype, local_dir=p.local_dir))
        model, _ = load_model(folder, self.mesh, p.dtype)
        self.tokenizer = load_tokenizer(folder)
        if self.tokenizer is None:
            raise JudgeError(f"judge {p.source}: its folder {folder} has no tokenizer")
        self.labels = label_token_ids(self.tokenizer, p.labels) if p.read == "label" else None
        reply = 1 if p.read == "label" else p.max_new_tokens
        self.sampler = make_sampler(model, self.tokenizer, p.max_prompt_length + reply)
        log.info("judge: %s loaded (%s, read: %s)", p.source, p.dtype, p.read)

    def render(self, prompt: str, completion: str, reference: str | None) -> str:
        text = self.params.rubric.format(prompt=question(prompt), completion=clean(completion),
                                         reference=clean(reference) if reference and clean(reference) else NO_REFERENCE)
        if not self.params.chat_template:
            return (self.tokenizer.bos_token or "") + text
        return render_prompt([{"role": "user", "content": text}], self.tokenizer, FormatParams())

    def score(self, prompts: list[str], completions: list[str], references: list[str | None]) -> JudgeScores:
        started = time.perf_counter()
        if self.sampler is None:
            self.load()
        p = self.params
        rubrics = [self.render(*row) for row in zip(prompts, completions, references)]
        lengths = np.asarray(prompt_lengths(self.tokenizer, rubrics)) if rubrics else np.zeros(0, int)
        values = np.full(len(rubrics), np.nan)
        mass = []
        fits = np.flatnonzero(lengths <= p.max_prompt_length)
        order = fits[np.argsort(lengths[fits], kind="stable")]  # similar lengths share a bucket
        for start in range(0, len(order), p.batch_size):
            rows = order[start : start + p.batch_size]
            bucket = min(max(SMALLEST_BUCKET, 1 << int(lengths[rows].max() - 1).bit_length()), p.max_prompt_length)
            batch = [rubrics[i] for i in rows]
            batch += [batch[-1]] * (p.batch_size - len(batch))  # one compiled shape per bucket
            if p.read == "label":
                scores, label_mass = self._read_labels(batch, bucket)
                mass.extend(label_mass[: len(rows)])
            else:
                scores = self._read_numbers(batch, bucket)
            values[rows] = scores[: len(rows)]
        malformed = int(np.isnan(values).sum())
        values = np.where(np.isnan(values), p.malformed_score, values)
        return JudgeScores(values, malformed, time.perf_counter() - started, float(np.mean(mass)) if mass else None)

    def _read_labels(self, batch: list[str], bucket: int) -> tuple[np.ndarray, np.ndarray]:
        flat = [t for ids in self.labels for t in ids]
        logprobs = self.sampler.next_token_logprobs(batch, bucket, flat)
        probs, at = np.exp(logprobs.astype(np.float64)), 0
        per_label = []
        for ids in self.labels:
            per_label.append(probs[:, at : at + len(ids)].sum(axis=1))
            at += len(ids)
        per_label = np.stack(per_label, axis=1)
        total = per_label.sum(axis=1)
        weights = np.asarray(list(self.params.labels.values()))
        return per_label @ weights / np.maximum(total, 1e-30), total

    def _read_numbers(self, batch: list[str], bucket: int) -> np.ndarray:
        out = self.sampler(batch, max_generation_steps=self.params.max_new_tokens, max_prompt_length=bucket,
                           eos_tokens=end_tokens(self.tokenizer))
        read = [read_number(clean(text), self.params.score_range) for text in out.text]
        return np.asarray([np.nan if v is None else v for v in read])
