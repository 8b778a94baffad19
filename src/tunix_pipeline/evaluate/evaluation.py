"""Evaluation: eval loss, the metrics people compare, and the report; the generation it scores is `generation`'s.

Every answer is read three ways (`score`), base and tuned given the same prompt (the recipe's
`format.system_prompt` states the format):
- `answer_accuracy` (strict): the answer inside a closed `<answer>…</answer>` equals the reference, exactly or
  numerically within `numeric_tolerance`;
- `lenient_accuracy`: GSM8K's flexible rule, the last number in the completion (`answers.last_number`);
- `format_compliance`: exactly `<reasoning>…</reasoning><answer>…</answer>`, each tag once;
each with its 95% Wilson interval (`<metric>_ci95`); `paired` sets a tuned model against its parent on the same
problems (McNemar's exact test, `paired_comparison`), `paired_base` and `paired_few_shot` against the base zero-shot
and shown `evaluate.few_shot` solved examples (`Evaluator.on_prompts`). Further metrics:
- `answer_exact`: the extracted answer equals the reference (after trimming and removing commas);
- `missing_answer`: no closed `<answer>…</answer>` (e.g. a model that never closes its tags);
- `truncated`: generation stopped at `max_new_tokens` without an end-of-turn;
- `repeated`: generation stopped because a block of `stop_repeats` or more tokens came twice back to back (a loop);
- `mean_completion_tokens` / `mean_completion_chars`;
- with several samples per prompt: `pass@k` (some sample right) and `majority@k`
  (the most common extracted answer is right); accuracies are then over all samples (pass@1);
- with `evaluate.judge`: `judge_score`, the judge model's mean score of all samples (and
  `judge_score_open_ended`, of the open-ended ones, when there are both kinds), and `judge_malformed`,
  the replies that gave no usable score, `judge_seconds` the time it took.

Open-ended rows (`open_ended`: writing, summaries) have no answer to match: the answer
metrics (accuracy, exact, missing answer, pass@k, majority@k) leave them out and
`open_ended_prompts` counts them; the judge scores them.

A prompt longer than `max_prompt_length` is skipped and counted (`prompts_too_long`),
an empty eval split gives a report that says so, not an exception.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

import jax
import mlflow
import numpy as np
import pandas as pd
from flax import nnx
from matplotlib.figure import Figure

from tunix_pipeline.config import EvaluateParams
from tunix_pipeline.core.paths import is_uri
from tunix_pipeline.core.runtime import hand_back_host_memory, process_rows, shard_rows
from tunix_pipeline.data.answers import answers_match, clean, normal, readings
from tunix_pipeline.data.formatting import is_open_ended
from tunix_pipeline.evaluate.significance import mcnemar, wilson_interval
from tunix_pipeline.generate.generation import Generator, KeptRows, select_prompts
from tunix_pipeline.stages import BY_NAME, Stage
from tunix_pipeline.tracking.mlflow_runs import mlflow_name
from tunix_pipeline.train.loop import eval_batches
from tunix_pipeline.train.loss import model_inputs, token_nll

log = logging.getLogger(__name__)

SAMPLE_COLUMNS = [
    "model", "id", "sample", "prompt", "reference", "open_ended", "generated", "extracted",
    "correct", "exact", "lenient", "lenient_correct", "well_formed", "judge_score", "completion_tokens", "truncated",
    "repeated", "scored_by",
]
# the three readings of an answer: each gets an interval, and a tuned model's paired test against its parent
READINGS = {"answer_accuracy": "correct", "lenient_accuracy": "lenient_correct", "format_compliance": "well_formed"}


# ---------------------------------------------------------------- eval loss
@nnx.jit
def _batch_nll(model, inputs):
    return token_nll(model, **inputs)


def evaluate_loss(model, rows: pd.DataFrame, batch_size: int, mesh) -> dict:
    """Token-weighted eval loss and perplexity over every row."""
    total, count = 0.0, 0.0
    with mesh:
        for batch in eval_batches(rows, batch_size, process_rows(mesh, batch_size)):
            inputs = model_inputs(shard_rows(batch, mesh))
            s, c = _batch_nll(model, inputs)
            total, count = total + float(s), count + float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": float(np.exp(loss)), "tokens": int(count)}


# ---------------------------------------------------------------- answers
def exact_match(predicted: str | None, reference: str) -> bool:
    return predicted is not None and normal(predicted) == normal(str(reference))


def vote_key(answer: str) -> str:
    """Answers that mean the same number vote together ("12", "12.0", "1,2" is not a number)."""
    text = normal(answer)
    try:
        value = float(text)
    except ValueError:
        return text
    return repr(value) if math.isfinite(value) else text


def majority_answer(answers: list[str | None]) -> str | None:
    """The most common extracted answer (ties: the first drawn); None when no sample has one."""
    present = [a for a in answers if a is not None]
    if not present:
        return None
    counts = Counter(vote_key(a) for a in present)
    best = max(counts.values())
    return next(a for a in present if counts[vote_key(a)] == best)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ---------------------------------------------------------------- metrics
def score(
    label: str,
    formatted: pd.DataFrame,
    generated: list[str],
    params: EvaluateParams,
    completion_tokens: list[int] | None = None,
    judged=None,
    repeated: list[bool] | None = None,
    scored_by: str | None = None,
) -> tuple[dict, pd.DataFrame]:
    """Metrics and one sample row per generation; `generated` holds `num_samples` consecutive texts per prompt;
    `judged`: the judge's result for them (`judge_generations`), or None; `repeated`: which ended repeating a block
    (`evaluate.stop_repeats`); `scored_by`: what the generations came from (`Evaluator.measure`)."""
    k = params.num_samples
    records = formatted.to_dict(orient="records")
    if len(generated) != len(records) * k:
        raise ValueError(f"{len(generated)} generations for {len(records)} prompts x {k} samples")
    have_tokens = bool(completion_tokens) and completion_tokens[0] is not None
    completion_tokens = completion_tokens if have_tokens else [None] * len(generated)
    rows = [_sample(label, records[j // k], j % k, text, n_tokens, params) | {"scored_by": scored_by}
            for j, (text, n_tokens) in enumerate(zip(generated, completion_tokens))]
    for row, cut in zip(rows, repeated or []):
        row["repeated"] = bool(cut)
    if judged is not None:
        for row, value in zip(rows, judged.values):
            row["judge_score"] = float(value)
    metrics = _scores(rows, records, params, have_tokens, bool(repeated))
    if judged is not None:
        metrics.update(_judge_metrics(rows, judged))
    return metrics, pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def _scores(rows: list[dict], records: list[dict], params: EvaluateParams, have_tokens: bool, repeated: bool) -> dict:
    """The metrics of scored rows (`score`'s, or an earlier evaluation's)."""
    k = params.num_samples
    # open-ended rows have no answer to match: the answer metrics cover the others
    answered = [r for r in rows if not r["open_ended"]]
    metrics = {
        "prompts": len(records),
        "open_ended_prompts": sum(map(is_open_ended, records)),
        "samples": len(rows),
        "answer_accuracy": _mean(r["correct"] for r in answered),
        "lenient_accuracy": _mean(r["lenient_correct"] for r in answered),
        "format_compliance": _mean(r["well_formed"] for r in rows),
        **{f"{name}_ci95": _interval(r[column] for r in (rows if name == "format_compliance" else answered))
           for name, column in READINGS.items()},
        "answer_exact": _mean(r["exact"] for r in answered),
        "missing_answer": _mean(r["extracted"] is None for r in answered),
        "truncated": _mean(r["truncated"] for r in rows) if have_tokens else None,
        "repeated": _mean(r["repeated"] for r in rows) if repeated else None,
        "mean_completion_tokens": _mean(r["completion_tokens"] for r in rows) if have_tokens else None,
        "mean_completion_chars": _mean(len(r["generated"]) for r in rows),
    }
    if k > 1:
        metrics.update(_per_prompt_metrics(answered, k, params.numeric_tolerance))
    return metrics


def _sample(label: str, record: dict, sample: int, text, n_tokens: int | None, params: EvaluateParams) -> dict:
    """One generation's row; `correct` and `exact` are None for an open-ended record (no answer to match)."""
    reference = str(record["answer"])
    read = readings(text, reference, params.numeric_tolerance)
    text, extracted = read["text"], read["extracted"]
    open_ended = is_open_ended(record)
    return {
        "model": label,
        "id": record["id"],
        "sample": sample,
        "prompt": record["prompt"],
        "reference": reference,
        "open_ended": open_ended,
        "generated": text,
        "extracted": extracted,
        "correct": None if open_ended else read["strict"],
        "exact": None if open_ended else exact_match(extracted, reference),
        "lenient": read["lenient_answer"],
        "lenient_correct": None if open_ended else read["lenient"],
        "well_formed": read["format"],
        "judge_score": None,
        "completion_tokens": n_tokens,
        "truncated": n_tokens is not None and n_tokens >= params.max_new_tokens,
        "repeated": False,
    }


def _mean(values) -> float | None:
    values = [float(v) for v in values]
    return float(np.mean(values)) if values else None


def _interval(values) -> dict | None:
    values = [bool(v) for v in values]
    return wilson_interval(sum(values), len(values))


def paired_comparison(parent: pd.DataFrame, model: pd.DataFrame) -> dict:
    """`model`'s samples against its `parent`'s on the problems both answered (matched by id and sample): per
    reading, McNemar's exact p and how many problems each got right that the other missed."""
    answered = ["id", "sample", *READINGS.values()]
    both = parent.loc[~parent["open_ended"].astype(bool), answered].merge(
        model.loc[~model["open_ended"].astype(bool), answered], on=["id", "sample"], suffixes=("_parent", ""))
    return {name: mcnemar(both[f"{column}_parent"].astype(bool).tolist(), both[column].astype(bool).tolist())
            for name, column in READINGS.items()}


def _per_prompt_metrics(rows: list[dict], k: int, tolerance: float) -> dict:
    """pass@k (some sample right) and majority@k (the most common answer right) over each prompt's k samples."""
    pass_k, majority_k = [], []
    for start in range(0, len(rows), k):
        group = rows[start : start + k]
        pass_k.append(pass_at_k(k, sum(r["correct"] for r in group), k))
        voted = majority_answer([r["extracted"] for r in group])
        majority_k.append(answers_match(voted, group[0]["reference"], tolerance))
    return {f"pass@{k}": float(np.mean(pass_k)) if pass_k else None,
            f"majority@{k}": float(np.mean(majority_k)) if majority_k else None}


def judge_generations(judge, formatted: pd.DataFrame, generated: list[str], k: int):
    """The judge's result (`judge.Judge.score`) for each generation (`k` consecutive ones per prompt): its prompt,
    its completion as scored, and the row's reference (None for an open-ended prompt without one)."""
    records = formatted.to_dict(orient="records")
    prompts = [r["prompt"] for r in records for _ in range(k)]
    references = [str(r["answer"]) or None for r in records for _ in range(k)]
    return judge.score(prompts, [clean(text) for text in generated], references)


def _judge_metrics(rows: list[dict], judged) -> dict:
    """The judge's mean score over all samples (and over the open-ended ones when there are both kinds), how many
    replies gave no usable score, and the time it took."""
    metrics = {"judge_score": _mean(r["judge_score"] for r in rows), "judge_malformed": int(judged.malformed),
               "judge_seconds": float(judged.seconds)}
    open_ended = [r for r in rows if r["open_ended"]]
    if open_ended and len(open_ended) < len(rows):
        metrics["judge_score_open_ended"] = _mean(r["judge_score"] for r in open_ended)
    return metrics


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _with_interval(metrics: dict, name: str) -> str:
    value, interval = metrics.get(name), metrics.get(f"{name}_ci95")
    if value is None:
        return "—"
    return f"{value:.3f} [{interval['low']:.3f}, {interval['high']:.3f}]" if interval else f"{value:.3f}"


def score_table(metrics: dict[str, dict]) -> str:
    """The fair score: each model's three readings with their 95% intervals, then each tuned model against its
    parent (`paired`): per reading, problems only it got right (+), only the parent (−), McNemar's exact p."""
    lines = ["| model | problems | strict | lenient | format |", "|---|---|---|---|---|"]
    for label, m in metrics.items():
        problems = (m.get("prompts") or 0) - (m.get("open_ended_prompts") or 0)
        lines.append(f"| {label} | {problems} | " + " | ".join(_with_interval(m, name) for name in READINGS) + " |")
    paired = [(label, m[key]) for label, m in metrics.items() for key in PAIRED_KEYS if m.get(key)]
    if paired:
        lines += ["", "| paired test | strict | lenient | format |", "|---|---|---|---|"]
        for label, test in paired:
            cells = [f"+{t['gained']} / −{t['lost']}, p = {t['p_value']:.2g}" for t in (test[n] for n in READINGS)]
            lines.append(f"| {label} vs {test['against']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# a model's paired tests: against its parent (the base for SFT), against the base zero-shot (a polish stage's), and
# against the base shown `evaluate.few_shot` solved examples (the base at its best)
PAIRED_KEYS = ("paired", "paired_base", "paired_few_shot")


def with_paired(results: dict[str, dict], samples: dict[str, pd.DataFrame], parent: str, model: str,
                key: str = "paired", parent_samples: pd.DataFrame | None = None) -> None:
    """Adds `model`'s paired test against `parent` to its metrics as `key` (both scored on the same problems);
    `parent_samples`: the parent's, when another evaluation scored it (else `samples[parent]`)."""
    parent_samples = samples.get(parent) if parent_samples is None else parent_samples
    if parent_samples is not None and len(parent_samples) and model in results and len(samples[model]):
        results[model][key] = {"against": parent, **paired_comparison(parent_samples, samples[model])}


def markdown_table(metrics: dict[str, dict], delta: tuple[str, str] | None = None) -> str:
    """Models side by side: one column per model, one row per metric; `delta=(a, b)` adds a b − a column."""
    models = list(metrics)
    names = []
    for m in models:
        for k, v in metrics[m].items():
            if k not in names and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))):
                names.append(k)
    header = models + ([f"{delta[1]} − {delta[0]}"] if delta else [])
    lines = ["| metric | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for name in names:
        cells = [_cell(metrics[m].get(name)) for m in models]
        if delta:
            a, b = metrics[delta[0]].get(name), metrics[delta[1]].get(name)
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
            cells.append(_cell(float(b - a)) if ok else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the evaluator
def prompt_length(tokenizer, eval_formatted: pd.DataFrame, eval_few_shot: pd.DataFrame, params: EvaluateParams) -> int:
    """The longest prompt length an evaluation's sampler is sized for: the scored prompts' and, with
    `evaluate.few_shot`, the k-shot ones' (0 with nothing to score)."""
    shots = eval_few_shot if params.few_shot and eval_few_shot is not None and len(eval_few_shot) else None
    return max(select_prompts(rows, tokenizer, params)[2] for rows in (eval_formatted, shots) if rows is not None)


class Evaluator:
    """Loss on the eval rows (`loss_rows` of them) and generation on the held-out prompts, for one model whose weights
    change; `judge` (a `judge.Judge`, or None) scores the generations; `decode_weights`: `runtime.decode_weights`."""

    def __init__(self, model, tokenizer, mesh, params: EvaluateParams, eval_tokens: pd.DataFrame,
                 eval_formatted: pd.DataFrame, loss_batch_size: int, judge=None, decode_weights: str = "sharded"):
        self.model, self.tokenizer, self.mesh, self.params = model, tokenizer, mesh, params
        self.decode_weights = decode_weights
        self.eval_tokens = eval_tokens if params.loss_rows is None else eval_tokens.head(params.loss_rows)
        self.loss_batch_size = loss_batch_size
        self.held_out, self.too_long, self.prompt_length = select_prompts(eval_formatted, tokenizer, params)
        self.judge = judge
        self._generator: Generator | None = None

    def on_prompts(self, formatted: pd.DataFrame) -> Evaluator:
        """The same model scored on other prompts for the same problems (`formatted` in the eval split's order: the
        few-shot ones): generation only, the eval loss being the zero-shot one's."""
        return Evaluator(self.model, self.tokenizer, self.mesh, self.params, self.eval_tokens.head(0), formatted,
                         self.loss_batch_size, self.judge, self.decode_weights)

    def measure(self, label: str, scored_by: str | None = None,
                earlier: pd.DataFrame | None = None) -> tuple[dict, pd.DataFrame]:
        """`label`'s metrics and rows. `scored_by`: what its generations depend on (`scored_by` in `policies`);
        `earlier`: rows another evaluation scored, whose generations are taken as they are where they have the same
        `scored_by` and prompts (greedy decoding of the same weights and settings writes the same texts)."""
        metrics: dict = {"eval_loss": None, "eval_perplexity": None, "eval_tokens": 0}
        hand_back_host_memory()  # each model scored starts without what scoring the one before it freed
        if len(self.eval_tokens):
            loss = evaluate_loss(self.model, self.eval_tokens, self.loss_batch_size, self.mesh)
            metrics = {f"eval_{k}": v for k, v in loss.items()}
            hand_back_host_memory()  # and its generation without what its loss freed (~2 GiB on a 262k vocabulary)
        if (rows := self._scored_before(scored_by, earlier)) is not None:
            log.info("evaluate: %s's %d generations taken from the evaluation that scored them (scored by %s)",
                     label, len(rows), scored_by)
            rows = [{**row, "model": label} for row in rows]
            scores = _scores(rows, self.held_out.to_dict(orient="records"), self.params,
                             have_tokens=rows[0]["completion_tokens"] is not None, repeated=bool(self.params.stop_repeats))
            return ({**metrics, **scores, "prompts_too_long": self.too_long, "generations_reused": True},
                    pd.DataFrame(rows, columns=SAMPLE_COLUMNS))
        prompts = self.held_out["prompt"].tolist()
        texts, lengths, judged, repeated = [], [], None, None
        if prompts:
            if self._generator is None:
                self._generator = Generator(self.model, self.tokenizer, self.params, self.prompt_length,
                                            self.decode_weights)
            with self.mesh:
                texts, lengths = self._generator(prompts, self._kept(scored_by))
            if self._generator.resumed:
                metrics["generations_resumed"] = self._generator.resumed
            repeated = self._generator.repeated if self.params.stop_repeats else None
            if self.judge is not None:
                judged = judge_generations(self.judge, self.held_out, texts, self.params.num_samples)
        scores, samples = score(label, self.held_out, texts, self.params, lengths, judged, repeated, scored_by)
        return {**metrics, **scores, "prompts_too_long": self.too_long}, samples

    def _kept(self, scored_by: str | None) -> KeptRows | None:
        """Where this policy's greedy rows are written as they end (`evaluate.generations_dir`, a file per
        `scored_by`); None with sampled decoding (a sampled row depends on the rows beside it), without a digest,
        over several processes (each would read its own disk's file, and their programs must stay the same) or
        on an object store (no appending there)."""
        folder = self.params.generations_dir
        if folder is None or scored_by is None or self.params.temperature > 0 or jax.process_count() > 1 \
                or is_uri(folder):
            return None
        return KeptRows(Path(folder) / f"{scored_by}.jsonl")

    def _scored_before(self, scored_by: str | None, earlier: pd.DataFrame | None) -> list[dict] | None:
        """The rows of `earlier` (one model's) scored by `scored_by` on exactly these prompts, in this order; None
        where there are none, a judge is on (its scores are not kept whole in the rows), or `earlier` lacks the
        columns to tell (an older or hand-edited file: the rows are generated)."""
        if scored_by is None or earlier is None or self.judge is not None or not len(self.held_out) \
                or not set(SAMPLE_COLUMNS) <= set(earlier.columns):
            return None
        k = self.params.num_samples
        wanted = pd.DataFrame({"id": np.repeat(self.held_out["id"].to_numpy(), k),
                               "sample": np.tile(np.arange(k), len(self.held_out)),
                               "prompt": np.repeat(self.held_out["prompt"].to_numpy(), k)})
        for _, rows in earlier[earlier["scored_by"] == scored_by].groupby("model", sort=False):
            rows = rows.reset_index(drop=True)
            if len(rows) == len(wanted) and rows[list(wanted)].astype(str).equals(wanted.astype(str)):
                return rows.astype(object).where(rows.notna(), None).to_dict(orient="records")
        return None


def open_ended_note(results: dict[str, dict]) -> str:
    """A sentence for the report when some evaluated prompts are open-ended (the answer metrics leave them out)."""
    counts = {m.get("open_ended_prompts") or 0 for m in results.values()}
    n, prompts = max(counts), max(m.get("prompts") or 0 for m in results.values())
    if not n:
        return ""
    judged = "the judge scores them (`judge_score`)" if any("judge_score" in m for m in results.values()) \
        else "set `evaluate.judge` to score them"
    return (f"\n{n} of the {prompts} prompts are open-ended (no answer to match): the answer metrics cover the other "
            f"{prompts - n}; {judged}.\n")


def empty_report(reason: str) -> str:
    return f"# Evaluation\n\nNothing was evaluated: {reason}\n"


# ---------------------------------------------------------------- curves
def training_curves(histories: dict[str, list[dict] | None], titles: dict[str, str] | None = None):
    """A matplotlib figure, a panel per stage that has a history ({stage name: its per-step history}, in the
    stages' order; the first stage's panel always): each stage's `curves` against the step."""
    drawn = [(BY_NAME[name], history) for name, history in histories.items()
             if history or BY_NAME[name].parent is None]
    fig = Figure(figsize=(6 * len(drawn), 4))
    axes = fig.subplots(1, len(drawn), squeeze=False)[0]
    for ax, (stage, history) in zip(axes, drawn):
        _panel(ax, stage, history or [])
        ax.set_title((titles or {}).get(stage.name, stage.name.upper()))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _panel(ax, stage: Stage, history: list[dict]) -> None:
    steps = [h["step"] for h in history]
    twin = None
    for curve in stage.curves:
        values = [h.get(curve.key) for h in history]
        if curve.twin and any(v is not None for v in values):
            twin = twin or ax.twinx()
            twin.plot(steps, values, color="tab:red", alpha=0.6, label=curve.label)
            twin.set_ylabel(curve.label)
        elif not curve.twin and history:
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=curve.label)
            if curve.log:
                ax.set_yscale("log")
    main = [curve for curve in stage.curves if not curve.twin]
    ax.set(xlabel="step", ylabel=main[0].label if len(main) == 1 else None)
    if len(main) > 1:
        ax.legend()


def log_figure(fig, name: str) -> None:
    """The figure as a PNG artifact of the active MLflow run (process 0 only); no run: nothing."""
    if mlflow.active_run() is not None and jax.process_index() == 0:
        mlflow.log_figure(fig, mlflow_name(name))
