"""lm-evaluation-harness over our JAX model: scores that can sit beside other people's.

`JaxLM` is an lm-eval `LM` backend: it tokenizes exactly as lm-eval's Hugging Face backend
(`hf`) does, so the same task on the same weights gives the same numbers:

- `loglikelihood` / `loglikelihood_rolling`: log-probabilities from our logits, in float32,
  for right-padded batches of fixed shapes (`batch_size` rows, lengths rounded up to a power
  of two), so XLA compiles once per length bucket;
- `generate_until`: Tunix's KV-cache sampler (greedy, or sampled when a task asks for it),
  with the prompt tokens lm-eval would feed, cut at the task's stop strings.

BOS: as `hf`, the tokenizer's own default decides (Gemma's adds one; a prompt that already
starts with BOS gets no second one), and an empty context is the BOS token. The settings
that make a score comparable (lm-eval and task versions, n-shot, chat template, limit, BOS)
go with the scores into the report and MLflow. `pip install -e ".[lm-eval]"`.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from tunix_pipeline.config import HarnessParams
from tunix_pipeline.errors import UserError
from tunix_pipeline.evaluation import make_sampler, markdown_table, next_power_of_two, sampling_args

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).with_name("harness_tasks")
TAGGED_TASK = "tagged_answer"
MIN_BUCKET = 16  # shortest padded length: fewer tiny buckets, each one a compile


class HarnessError(UserError, ValueError):
    """The harness cannot run as configured."""


def _lm_eval():
    try:
        import lm_eval
    except ImportError as err:
        raise HarnessError(
            'evaluate.harness.enabled needs lm-evaluation-harness: pip install -e ".[lm-eval]" '
            "(or set evaluate.harness.enabled: false)"
        ) from err
    return lm_eval


def check(params: HarnessParams) -> None:
    """Fails before any model loads: lm-eval missing, a task file missing, or several JAX processes."""
    import jax

    _lm_eval()
    for task in params.tasks:
        if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
            raise HarnessError(f"evaluate.harness.tasks: no task file {task}; give an lm-eval task name or a YAML path")
    if jax.process_count() > 1:
        raise HarnessError("evaluate.harness runs in one JAX process; set evaluate.harness.enabled: false on a pod")


# ---------------------------------------------------------------- the tagged-answer task's rows
def write_rows(formatted: pd.DataFrame, tokenizer, path: Path) -> Path:
    """The eval rows as the tagged-answer task reads them: the prompt without its leading BOS text
    (the tokenizer adds the token, as in lm-eval's HF backend), the tagged completion and the answer."""
    bos = tokenizer.bos_token or ""
    with open(path, "w", encoding="utf-8") as out:
        for row in formatted.to_dict(orient="records"):
            prompt = row["prompt"][len(bos):] if bos and row["prompt"].startswith(bos) else row["prompt"]
            out.write(json.dumps({"id": row["id"], "prompt": prompt, "completion": row["completion"],
                                  "answer": str(row["answer"])}, ensure_ascii=False) + "\n")
    return path


def task_specs(tasks: list[str], rows: Path | None) -> tuple[list, list[str]]:
    """(what lm-eval loads: names or task configs, folders holding task YAML files to index)."""
    import yaml

    specs, include = [], []
    for task in tasks:
        if task == TAGGED_TASK:
            if rows is None:
                raise HarnessError(f"evaluate.harness: the {TAGGED_TASK} task needs eval rows (ingest.eval_fraction > 0)")
            config = yaml.safe_load((TASKS_DIR / f"{TAGGED_TASK}.yaml").read_text())
            # the rows' Arrow cache beside them (a temporary folder), not in ~/.cache
            config["dataset_kwargs"] = {"data_files": {"test": str(rows)}, "cache_dir": str(rows.parent / "datasets")}
            specs.append(config)
        elif task.endswith((".yaml", ".yml")):
            include.append(str(Path(task).resolve().parent))
            specs.append(yaml.safe_load(Path(task).read_text())["task"])
        else:
            specs.append(task)
    return specs, sorted(set(include))


# ---------------------------------------------------------------- the backend
def _lm_class():
    _lm_eval()
    from lm_eval.api.model import TemplateLM
    from lm_eval.models import utils as lm_utils
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

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

    return JaxLM


@functools.cache
def _logprobs_fn():
    """log p(target) and argmax == target at each position: the (B, L, V) log-softmax never leaves the device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import utils as sft_utils

    @nnx.jit
    def logprobs(model, tokens, mask, targets):
        mask = mask.astype(bool)
        logits, _ = model(tokens, sft_utils.build_positions_from_mask(mask), None, sft_utils.make_causal_attn_mask(mask))
        logits = logits.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets

    return logprobs


def make_lm(model, tokenizer, mesh, params: HarnessParams, model_dir: str | Path):
    """The backend for the model loaded from `model_dir` (its config.json gives the context and EOS ids)."""
    return _lm_class()(model, tokenizer, mesh, params.batch_size, model_max_length(model_dir, params), params.seed,
                       generation_eos_ids(model_dir))


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """The EOS ids transformers' `generate` stops at: generation_config.json's, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
            if ids is not None:
                return list(ids) if isinstance(ids, list) else [ids]
    return []


def model_max_length(model_dir: str | Path, params: HarnessParams) -> int:
    """`harness.max_length`, else the model's context as lm-eval's HF backend reads it from config.json."""
    if params.max_length:
        return params.max_length
    from lm_eval.models.utils import resolve_max_length
    from transformers import AutoConfig

    return resolve_max_length(AutoConfig.from_pretrained(model_dir), None)


# ---------------------------------------------------------------- running tasks
def evaluate(lm, params: HarnessParams, rows: Path | None) -> dict:
    """lm-eval's `simple_evaluate` on `lm`: {"scores": {task: {metric: value}}, "settings": ...}."""
    from lm_eval import evaluator

    specs, include = task_specs(params.tasks, rows)
    manager = _task_manager(tuple(include), builtin=any(isinstance(spec, str) for spec in specs))
    result = evaluator.simple_evaluate(
        model=lm, tasks=specs, num_fewshot=params.num_fewshot, limit=params.limit,
        apply_chat_template=params.apply_chat_template, gen_kwargs=_gen_kwargs(params), task_manager=manager,
        log_samples=False, bootstrap_iters=1000, random_seed=params.seed, numpy_random_seed=params.seed,
        torch_random_seed=None, fewshot_random_seed=params.seed,
    )
    scores = {  # "metric,filter" keys; not the alias or sample_len
        task: {k: float(v) for k, v in metrics.items() if "," in k and isinstance(v, (int, float))}
        for task, metrics in result["results"].items()
    }
    return {"scores": scores, "settings": settings(result, params, lm)}


@functools.cache
def _task_manager(include: tuple[str, ...], builtin: bool):
    """lm-eval's task index: its built-in tasks only when a task is named (indexing them takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=builtin)


def _gen_kwargs(params: HarnessParams) -> dict | None:
    return {"max_gen_toks": params.max_gen_toks} if params.max_gen_toks else None


def prepends_bos(lm) -> bool:
    """Whether `lm` starts a prompt with BOS (ours and `hf` both: when the tokenizer's default does)."""
    bos = lm.tokenizer.bos_token_id
    return bos is not None and lm.tok_encode("1")[:1] == [bos]


def settings(result: dict, params: HarnessParams, lm) -> dict:
    """What a reader needs to compare these scores with others."""
    import lm_eval

    samples = {task: v.get("effective") for task, v in result.get("n-samples", {}).items()}
    return {
        "lm_eval_version": lm_eval.__version__,
        "task_versions": {task: str(v) for task, v in result.get("versions", {}).items()},
        "num_fewshot": dict(result.get("n-shot", {})),
        "apply_chat_template": params.apply_chat_template,
        "limit": params.limit,
        "full_task": params.limit is None,
        "documents": samples,
        "bos": ("prepended" if prepends_bos(lm) else "none") + " (the tokenizer's default, as lm-eval's hf backend)",
        "max_length": lm.max_length,
        "max_gen_toks": params.max_gen_toks,
    }


class Harness:
    """lm-eval on one model whose weights change (base, then tuned): built once per evaluate node."""

    def __init__(self, model, tokenizer, mesh, params: HarnessParams, model_dir: str | Path, eval_formatted: pd.DataFrame):
        self.params = params
        self._tmp = tempfile.TemporaryDirectory(prefix="harness_")
        self.rows = write_rows(eval_formatted, tokenizer, Path(self._tmp.name) / "eval_rows.jsonl") if len(eval_formatted) else None
        self.lm = make_lm(model, tokenizer, mesh, params, model_dir)

    def measure(self, label: str) -> dict:
        log.info("evaluate: lm-eval tasks %s on the %s model", self.params.tasks, label)
        return evaluate(self.lm, self.params, self.rows)

    def close(self) -> None:
        self._tmp.cleanup()


def report(results: dict[str, dict], delta: tuple[str, str] | None = None) -> str:
    """The lm-eval scores of several models as a Markdown section, with the settings that make them comparable."""
    models = list(results)
    first = results[models[0]]["settings"]
    table = {m: {f"{task} {metric}": v for task, metrics in results[m]["scores"].items()
                 for metric, v in metrics.items() if "_stderr" not in metric} for m in models}
    limit = first["limit"]
    share = f"{limit} documents" if limit is None or limit >= 1 else f"{limit:.0%} of the documents"
    scope = "full tasks" if limit is None else f"limit {share} per task: NOT a full-task score"
    lines = [
        "## lm-evaluation-harness",
        "",
        f"lm-eval {first['lm_eval_version']}; tasks (version): "
        + ", ".join(f"{t} ({v})" for t, v in first["task_versions"].items())
        + f"; n-shot: {first['num_fewshot']}; chat template: {'on' if first['apply_chat_template'] else 'off'}; "
        f"{scope} (documents: {first['documents']}); BOS: {first['bos']}.",
        "",
        markdown_table(table, delta=delta),
    ]
    return "\n".join(lines)
