"""lm-evaluation-harness over our JAX model: scores that can sit beside other people's.

`JaxLM` (`harness_lm`) is an lm-eval `LM` backend: it tokenizes exactly as lm-eval's Hugging Face backend
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

import jax
import pandas as pd
import yaml
from transformers import AutoConfig

from tunix_pipeline.config import HarnessParams
from tunix_pipeline.config.validation import closest
from tunix_pipeline.core.errors import HarnessError
from tunix_pipeline.data.formatting import answer_rows
from tunix_pipeline.evaluate.evaluation import markdown_table
from tunix_pipeline.generate.generation import scored_split

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).with_name("harness_tasks")
TAGGED_TASK = "tagged_answer"


def _lm_eval():
    try:
        import lm_eval  # optional: the lm-eval extra
    except ImportError as err:
        raise HarnessError(
            'evaluate.harness.enabled needs lm-evaluation-harness: pip install -e ".[lm-eval]" '
            "(or set evaluate.harness.enabled: false)"
        ) from err
    return lm_eval


def check(params: HarnessParams) -> None:
    """Fails before any model loads (and before the run starts: `preflight`): lm-eval missing, a task it does not
    know, a task file missing, or several JAX processes."""
    _lm_eval()
    for task in params.tasks:
        if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
            raise HarnessError(f"evaluate.harness.tasks: no task file {task}; give an lm-eval task name or a YAML path")
    named = [t for t in params.tasks if t != TAGGED_TASK and not t.endswith((".yaml", ".yml"))]
    if named:  # lm-eval's own lookup fails late, with a KeyError
        known = _task_manager((), builtin=True).task_index
        for task in named:
            if task not in known:
                raise HarnessError(f"evaluate.harness.tasks: {task!r} is not one of lm-eval's tasks, groups or tags"
                                   f"{closest(task, known)}")
    for task, files in params.data_files.items():
        for split, path in files.items():
            if not Path(path).is_file():
                raise HarnessError(f"evaluate.harness.data_files.{task}.{split}: no file {path}")
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


def task_specs(tasks: list[str], rows: Path | None, data_files: dict | None = None) -> tuple[list, list[str]]:
    """(what lm-eval loads: names or task configs, folders holding task YAML files to index)."""
    specs, include = [], []
    for task in tasks:
        if task in (data_files or {}):
            specs.append(local_task(task, data_files[task]))
        elif task == TAGGED_TASK:
            if rows is None:
                raise HarnessError(f"evaluate.harness: the {TAGGED_TASK} task needs eval rows with an answer "
                                   "(ingest.eval_fraction > 0; open-ended rows have none)")
            from lm_eval.tasks._yaml_loader import load_yaml  # optional (lm-eval); its reader resolves `!function`

            config = load_yaml(str(TASKS_DIR / f"{TAGGED_TASK}.yaml"), resolve_func=True)
            # the rows' Arrow cache beside them (a temporary folder), not in ~/.cache
            config["dataset_kwargs"] = {"data_files": {"test": str(rows)}, "cache_dir": str(rows.parent / "datasets")}
            specs.append(config)
        elif task.endswith((".yaml", ".yml")):
            include.append(str(Path(task).resolve().parent))
            specs.append(yaml.safe_load(Path(task).read_text())["task"])
        else:
            specs.append(task)
    return specs, sorted(set(include))


def local_task(name: str, files: dict[str, str]) -> dict:
    """lm-eval's own config of task `name` (its YAML, includes resolved, as lm-eval reads it) with its dataset
    read from local JSON lines files, one per split: the prompt, few-shot split, filters and metrics are lm-eval's."""
    from lm_eval.tasks._index import Kind  # optional: the lm-eval extra
    from lm_eval.tasks._yaml_loader import load_yaml  # optional (lm-eval); its reader (includes, !function)

    entry = _task_manager((), builtin=True).task_index.get(name)
    if entry is None or not entry.yaml_path or entry.kind != Kind.TASK:
        raise HarnessError(f"evaluate.harness.data_files: {name} is not one of lm-eval's YAML tasks")
    config = load_yaml(entry.yaml_path, resolve_func=True)
    config.pop("tag", None)  # a tag would make lm-eval index this copy beside its own task
    data = {split: str(Path(path).resolve()) for split, path in files.items()}
    return {**config, "dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": data}}


# ---------------------------------------------------------------- the backend
def make_lm(model, tokenizer, mesh, params: HarnessParams, model_dir: str | Path):
    """The backend for the model loaded from `model_dir` (its config.json gives the context and EOS ids)."""
    _lm_eval()
    from tunix_pipeline.evaluate.harness_lm import JaxLM  # optional: subclasses lm-eval's model (the lm-eval extra)

    return JaxLM(model, tokenizer, mesh, params.batch_size, model_max_length(model_dir, params), params.seed,
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
    from lm_eval.models.utils import resolve_max_length  # optional: the lm-eval extra

    return resolve_max_length(AutoConfig.from_pretrained(model_dir), None)


# ---------------------------------------------------------------- running tasks
def evaluate(lm, params: HarnessParams, rows: Path | None, samples: bool = False) -> dict:
    """lm-eval's `simple_evaluate` on `lm`: {"scores": {task: {metric: value}}, "settings": ...}; with `samples`,
    also each document's generation and what each filter read from it: {"samples": {task: [...]}}."""
    from lm_eval import evaluator  # optional: the lm-eval extra

    specs, include = task_specs(params.tasks, rows, params.data_files)
    manager = _task_manager(tuple(include), builtin=any(isinstance(spec, str) for spec in specs))
    result = evaluator.simple_evaluate(
        model=lm, tasks=specs, num_fewshot=params.num_fewshot, limit=params.limit,
        apply_chat_template=params.apply_chat_template, gen_kwargs=_gen_kwargs(params), task_manager=manager,
        log_samples=samples, bootstrap_iters=1000, random_seed=params.seed, numpy_random_seed=params.seed,
        torch_random_seed=None, fewshot_random_seed=params.seed,
    )
    scores = {  # "metric,filter" keys; not the alias or sample_len
        task: {k: float(v) for k, v in metrics.items() if "," in k and isinstance(v, (int, float))}
        for task, metrics in result["results"].items()
    }
    out = {"scores": scores, "settings": settings(result, params, lm)}
    if samples:
        out["samples"] = {task: [{"doc_id": s["doc_id"], "filter": s["filter"], "resps": s["resps"],
                                  "filtered_resps": s["filtered_resps"], "target": s["target"]} for s in logged]
                          for task, logged in result["samples"].items()}
    return out


def write_samples(samples: dict[str, list[dict]], folder: Path, label: str) -> None:
    """One JSON line per document and filter, in <label>_<task>.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    for task, rows in samples.items():
        with open(folder / f"{label}_{task}.jsonl", "w", encoding="utf-8") as out:
            out.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)


@functools.cache
def _task_manager(include: tuple[str, ...], builtin: bool):
    """lm-eval's task index: its built-in tasks only when a task is named (indexing them takes seconds)."""
    from lm_eval.tasks import TaskManager  # optional: the lm-eval extra

    return TaskManager(include_path=list(include) or None, include_defaults=builtin)


def _gen_kwargs(params: HarnessParams) -> dict | None:
    return {"max_gen_toks": params.max_gen_toks} if params.max_gen_toks else None


def prepends_bos(lm) -> bool:
    """Whether `lm` starts a prompt with BOS (ours and `hf` both: when the tokenizer's default does)."""
    bos = lm.tokenizer.bos_token_id
    return bos is not None and lm.tok_encode("1")[:1] == [bos]


def settings(result: dict, params: HarnessParams, lm) -> dict:
    """What a reader needs to compare these scores with others."""
    import lm_eval  # optional: the lm-eval extra

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
        # tagged_answer scores the rows our evaluation scores, with an answer to match (open-ended rows have none)
        answered = answer_rows(scored_split(eval_formatted))
        self.rows = write_rows(answered, tokenizer, Path(self._tmp.name) / "eval_rows.jsonl") if len(answered) else None
        self.lm = make_lm(model, tokenizer, mesh, params, model_dir)

    def measure(self, label: str) -> dict:
        log.info("evaluate: lm-eval tasks %s on the %s model", self.params.tasks, label)
        result = evaluate(self.lm, self.params, self.rows, samples=self.params.samples_dir is not None)
        if self.params.samples_dir is not None:
            write_samples(result.pop("samples"), Path(self.params.samples_dir), label)
        return result

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
