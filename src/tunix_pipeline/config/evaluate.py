"""Settings of evaluation (`evaluate`, lm-evaluation-harness), `export` and `tracking` (MLflow, W&B, the registry)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tunix_pipeline.config.base import Location, Strict
from tunix_pipeline.config.polish import JudgeParams


class HarnessParams(Strict):
    """lm-evaluation-harness tasks on the base and the tuned model (`pip install -e ".[lm-eval]"`)."""

    enabled: bool = False
    # lm-eval task names (gsm8k, mmlu, ...; their data comes from the hub), paths to task YAML files, or
    # tagged_answer: the project's eval rows, the answer read from <answer>…</answer> (harness_tasks/)
    tasks: list[str] = Field(["tagged_answer"], min_length=1)
    num_fewshot: int | None = Field(None, ge=0, description="null: each task's own default")
    # documents per task (a fraction below 1: that share); a run with a limit is not a full-task score
    limit: int | float | None = Field(None, gt=0)
    apply_chat_template: bool = False  # tagged_answer's prompts are already in the model's chat format
    batch_size: int = Field(8, gt=0, description="sequences per forward pass or generation call")
    max_length: int | None = Field(None, gt=0, description="context in tokens; null: the model's, as lm-eval's HF backend")
    max_gen_toks: int | None = Field(None, gt=0, description="overrides the tasks' max_gen_toks")
    seed: int = 0
    # an lm-eval task -> its splits read from local files instead of the hub, the task's own prompt, few-shot
    # split, filters and metrics kept: {gsm8k: {train: data/01_raw/gsm8k/train.jsonl, test: .../test.jsonl}}
    data_files: dict[str, dict[str, str]] = {}
    # a folder: each model's documents as lm-eval saw them (generation, what each filter read, the target) in
    # <model>_<task>.jsonl, to compare backends or read what a score counted; null: scores only
    samples_dir: str | None = None

    @model_validator(mode="after")
    def _limit(self):
        if isinstance(self.limit, float) and self.limit >= 1 and not self.limit.is_integer():
            raise ValueError(f"limit {self.limit}: a whole number of documents, or a fraction below 1")
        unknown = sorted(set(self.data_files) - set(self.tasks))
        if unknown:
            raise ValueError(f"data_files names {unknown}, which tasks {self.tasks} do not list")
        return self


class EvaluateParams(Strict):
    num_prompts: int = Field(16, ge=0, description="held-out prompts to generate for")
    # the eval loss's forward pass over every row (and a 262k-word output layer) can cost more than
    # generating: a CPU run measures it on the first rows only
    loss_rows: int | None = Field(None, gt=0, description="eval token rows the eval loss covers; null: all")
    max_new_tokens: int = Field(48, gt=0)
    # a row ends once a block of this many to twice as many of its tokens has come twice back to back (kept): a
    # greedy model in a loop does not leave it, and its row would run to max_new_tokens; null: off
    stop_repeats: int | None = Field(16, ge=2, description="tokens in the shortest repeated block that ends a row")
    # prompts longer than this (in tokens) are skipped and counted; null: room for the longest one
    max_prompt_length: int | None = Field(None, gt=0)
    batch_size: int = Field(8, gt=0, description="sequences per generation call (prompts x samples)")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    num_samples: int = Field(1, ge=1, description="samples per prompt; >1 adds pass@k and majority@k")
    seed: int = 0
    numeric_tolerance: float = Field(1e-6, ge=0)
    compare_base_model: bool = True
    # k solved examples from the training split (drawn once with `seed`) before each problem, as earlier turns of
    # the same chat in the same tagged format: the base model at its best, as lm-eval's few-shot GSM8K shows it.
    # `base`: the base is scored zero-shot and k-shot side by side; `all`: every model evaluated is scored both ways
    few_shot: int = Field(0, ge=0, description="solved training examples before each problem; 0: zero-shot only")
    few_shot_models: Literal["base", "all"] = "base"
    harness: HarnessParams = HarnessParams()
    # a folder where each greedy row is written as it ends (a file per policy and settings): an evaluation stopped
    # part-way takes them on the next run and generates only the rest; null: not kept
    generations_dir: Location | None = "data/07_model_output/generations"
    # a judge model scoring every generated completion (`judge_score`, beside the answer metrics): what open-ended
    # prompts (writing, summaries) are measured by; null: no judge
    judge: JudgeParams | None = None

    @model_validator(mode="after")
    def _sampling(self):
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError("num_samples > 1 needs temperature > 0 (greedy samples are all the same)")
        if (self.top_p is not None or self.top_k is not None) and self.temperature == 0:
            raise ValueError("top_p / top_k need temperature > 0 (temperature 0 is greedy)")
        if self.few_shot and self.few_shot_models == "base" and not self.compare_base_model:
            raise ValueError("few_shot scores the base model: set compare_base_model: true, or few_shot_models: all")
        return self

class ExportParams(Strict):
    output_dir: Location = "data/06_models/exported"  # a local folder or a gs://bucket/path URI
    max_shard_size: str = "2GB"
    # the folder's weights: null as trained (model.dtype); bfloat16 ships float32 masters at half the bytes
    dtype: Literal["float32", "bfloat16"] | None = None
    # hf: the Hugging Face folder (always: the other stages and vLLM read it); gguf: also GGUF files and an
    # Ollama Modelfile in gguf_dir, one file per type in gguf_types
    formats: list[Literal["hf", "gguf"]] = ["hf"]
    gguf_dir: Location = "data/06_models/gguf"  # a local folder or a gs://bucket/path URI
    gguf_types: list[Literal["f32", "f16", "bf16", "q8_0"]] = Field(["f16", "q8_0"], min_length=1)

    @model_validator(mode="after")
    def _check(self):
        if "hf" not in self.formats:
            raise ValueError(
                f"formats must include hf (the folder the other stages read), got {self.formats}: use [hf, gguf]"
            )
        if len(set(self.gguf_types)) != len(self.gguf_types):
            raise ValueError(f"gguf_types lists a type twice: {self.gguf_types}")
        return self


class WandbParams(Strict):
    """Weights & Biases as a second tracker of the training curves (Tunix's own backend)."""

    enabled: bool = False
    project: str = "tunix_pipeline"
    entity: str | None = None
    mode: Literal["online", "offline"] = "online"  # offline: a local run folder to `wandb sync` later


class SystemMetricsParams(Strict):
    """MLflow's system metrics (CPU, memory, disk, network; GPU with nvidia-ml-py) while SFT and GRPO train."""

    enabled: bool = True
    interval_s: float = Field(10.0, gt=0, description="seconds between samples")


class RegistryParams(Strict):
    """The exported model as an MLflow model, registered as a new version of `name` (a copy of its weights)."""

    enabled: bool = True
    name: str = Field("tunix_pipeline", min_length=1)


class TrackingParams(Strict):
    enabled: bool = True
    experiment: str = "tunix_pipeline"
    # MLFLOW_TRACKING_URI, when set, wins over this default.
    tracking_uri: str = "sqlite:///data/mlflow.db"
    wandb: WandbParams = WandbParams()
    system_metrics: SystemMetricsParams = SystemMetricsParams()
    register_model: RegistryParams = RegistryParams()
    # Node outputs logged to the run: dicts as JSON + numeric metrics,
    # DataFrames as JSONL, strings as text.
    log_outputs: list[str]  # no default: conf/base lists them
