"""Typed parameters: one pydantic model per `parameters_<stage>.yml` section.

Nodes type-hint their `params:` inputs with these models, so Kedro validates
the whole configuration before any node runs; unknown keys are errors
(`extra="forbid"`), which catches typos such as `max_step`.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- ingest
class HubDataset(Strict):
    """Arguments of `datasets.load_dataset(path, name, split=..., ...)`; with the source's `max_rows` it streams."""

    path: str
    name: str | None = None
    split: str = "train"
    data_files: str | list[str] | None = None
    revision: str | None = None
    # streamed rows pass through a buffer of this many, shuffled with `ingest.seed` (the shards' order too):
    # about max_rows + shuffle_buffer rows are read; null takes the first max_rows rows
    shuffle_buffer: int | None = Field(None, gt=0)


class SourceParams(Strict):
    name: str
    path: str | None = Field(None, description="local .jsonl/.json/.parquet/.csv file")
    hf: HubDataset | None = None
    format: Literal["gsm8k", "alpaca", "messages", "prompt_response", "preference"]
    # canonical field -> column name in this source, e.g. {question: problem}
    columns: dict[str, str] = {}
    weight: float = Field(1.0, gt=0, description="multiplies this source's share of train rows")
    max_rows: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_location(self):
        if (self.path is None) == (self.hf is None):
            raise ValueError(f"source '{self.name}': set exactly one of `path` or `hf`")
        if self.hf is not None and self.hf.shuffle_buffer is not None and self.max_rows is None:
            raise ValueError(
                f"source '{self.name}': hf.shuffle_buffer picks max_rows rows from a stream; set `max_rows`, or remove "
                "`shuffle_buffer` (a source read whole is shuffled anyway before the train/eval split)"
            )
        return self


class IngestParams(Strict):
    sources: list[SourceParams] = Field(min_length=1)
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    seed: int = 0
    dedup: bool = True
    on_bad_row: Literal["skip", "fail"] = "skip"

    @model_validator(mode="after")
    def _unique_names(self):
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        pairs = [s.name for s in self.sources if s.format == "preference"]
        if pairs and len(pairs) != len(self.sources):
            raise ValueError(
                f"sources {pairs} hold preference pairs and the others single answers; list preference sources "
                "under `preference.data.sources`, the others under `ingest.sources`"
            )
        return self


# ---------------------------------------------------------------- model
class TinyModelParams(Strict):
    """A Gemma-architecture model with random weights, built offline."""

    vocab_size: int = Field(512, ge=300)
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 16
    seed: int = 0


class LoraParams(Strict):
    """LoRA adapters through qwix; `quantize: nf4` makes it QLoRA (a frozen 4-bit base)."""

    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    # regex over module paths, e.g. ".*attn.*|.*mlp.*"
    target_modules: str = ".*(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
    quantize: Literal["nf4"] | None = None


class ModelParams(Strict):
    # "tiny" (built locally from `tiny`), a local Hugging Face folder, a local .gguf file (or a folder holding
    # one), a hub id, or "kaggle:<handle>"
    source: str = "tiny"
    revision: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    local_dir: str = Field("data/06_models/base_model", description="where `tiny` is built or a .gguf source converted")
    tiny: TinyModelParams = TinyModelParams()
    # null: full fine-tuning
    lora: LoraParams | None = None


# ---------------------------------------------------------------- format / tokenize
class FormatParams(Strict):
    # auto: the tokenizer's own chat template if it has one, else Gemma's turn format
    chat_template: Literal["auto", "gemma"] = "auto"
    system_prompt: str | None = None


class TokenizeParams(Strict):
    max_length: int = Field(gt=8)
    overflow: Literal["truncate", "drop"] = "truncate"
    # several short examples per row (segment ids keep attention within each)
    pack: bool = False
    histogram_bins: int = Field(10, gt=0)


# ---------------------------------------------------------------- runtime / sft / evaluate
class DistributedParams(Strict):
    """Arguments of `jax.distributed.initialize` (one process per host)."""

    coordinator_address: str
    num_processes: int = Field(gt=0)
    process_id: int = Field(ge=0)


class RuntimeParams(Strict):
    # the folder every output goes under (the catalog reads the same value through globals/runtime_params);
    # the checkpoints, sessions ledger and export under it also accept a gs://bucket/path URI (`gcs` extra)
    output_root: str = "data"
    # Fake CPU devices to expose when JAX runs on the CPU (no effect on GPU/TPU).
    host_device_count: int = Field(8, ge=1)
    # "auto": every device on the fsdp axis; or explicit sizes, e.g. {data: 2, fsdp: 4, tp: 1}
    mesh: Literal["auto"] | dict[Literal["data", "fsdp", "tp"], int] = "auto"
    # multi-host: off (one process), auto (JAX finds the cluster: TPU pods, SLURM, ...), or explicit
    distributed: Literal["off", "auto"] | DistributedParams = "off"
    # multi-host: how long a process looks for the file process 0 wrote in each checkpoint folder before
    # the run stops, saying the folder is not shared (a shared filesystem may show new files late)
    shared_folder_timeout_s: float = Field(20.0, gt=0)
    # the accelerator's peak bf16 FLOP/s per device, for MFU; null: the plan's hardware profile's peak
    peak_flops_per_device: float | None = Field(None, gt=0)


class OptimizerParams(Strict):
    """The optimizer and its learning-rate schedule, as every training stage builds it (`optim.make_optimizer`).

    Not a config section of its own: each stage's `optim` property gathers it from that stage's keys.
    """

    optimizer: Literal["adamw", "adafactor"] = "adamw"
    learning_rate: float = Field(gt=0)
    max_steps: int = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # decoupled weight decay on matrices only (not norms or biases)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)


class SftParams(Strict):
    # 0 only with init_from: no training this session, the parent checkpoint passes on (e.g. to GRPO);
    # null with `epochs`: the steps follow from the training rows
    max_steps: int | None = Field(ge=0)
    # passes over the training rows instead of max_steps (set max_steps: null); the trainer turns it into
    # optimizer steps once the rows are known (`steps_for`), the plan from plan.train_rows
    epochs: float | None = Field(None, gt=0)
    per_device_batch_size: int = Field(gt=0)
    # optimizer steps average this many micro-batches (global batch = per-device x data devices x this)
    gradient_accumulation_steps: int = Field(1, gt=0)
    optimizer: Literal["adamw", "adafactor"] = "adamw"
    learning_rate: float = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # decoupled weight decay on matrices only (not norms or biases)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    # bfloat16: compute in bf16 while the weights (and optimizer) stay in model.dtype, e.g. fp32 masters
    compute_dtype: Literal["bfloat16"] | None = None
    # activation rematerialisation: none, attention (each attention block), decoder (each whole layer)
    remat: Literal["none", "attention", "decoder"] = "none"
    # cross-entropy in chunks of this many positions (less memory for large vocabularies); null: at once
    loss_chunk_size: int | None = Field(None, gt=0)
    checkpoint_dir: str = "data/06_models/sft_checkpoints"  # a local folder or a gs://bucket/path URI
    checkpoint_every: int = Field(gt=0)
    keep_checkpoints: int = Field(3, gt=0)
    eval_every: int | None = Field(None, gt=0)
    # stop early enough to save a checkpoint before this many hours pass since the process started
    # (Kaggle sessions: 9); null: no limit
    time_budget_hours: float | None = Field(None, gt=0)
    seed: int = 0
    # start from another run's checkpoint folder (full or LoRA, its latest step): its weights, with this
    # run's data, a fresh optimizer and step 0. Not a resume: an interrupted run resumes from checkpoint_dir.
    init_from: str | None = None

    @model_validator(mode="after")
    def _warmup_fits(self):
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError(
                "set exactly one of sft.max_steps and sft.epochs (to train by epochs, also set max_steps: null)"
                if self.epochs is not None else "set sft.max_steps, or sft.epochs with max_steps: null"
            )
        if self.max_steps == 0 and self.init_from is None:
            raise ValueError("max_steps: 0 (no training) needs init_from: the checkpoint to pass on")
        if self.max_steps and self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps})"
            )
        return self

    def steps_for(self, train_rows: int, micro_batch: int) -> "SftParams":
        """This configuration with `max_steps` set: as configured, or `epochs` passes over `train_rows` rows.

        `micro_batch`: rows per micro-batch (per-device batch x data-parallel devices). The trainer
        drops each epoch's incomplete micro-batch (one shape, one compile), and an optimizer step
        takes `gradient_accumulation_steps` micro-batches.
        """
        if self.epochs is None:
            return self
        per_epoch = train_rows // micro_batch
        if per_epoch == 0:
            raise ValueError(
                f"sft.epochs: {train_rows} training rows cannot fill one micro-batch of {micro_batch} rows; "
                "lower sft.per_device_batch_size or add data"
            )
        steps = max(1, -(-int(self.epochs * per_epoch) // self.gradient_accumulation_steps))
        if self.warmup_steps >= steps:
            raise ValueError(
                f"sft.epochs: {self.epochs:g} epochs of {train_rows} rows are {steps} optimizer steps, "
                f"not more than warmup_steps ({self.warmup_steps}); lower sft.warmup_steps"
            )
        return self.model_copy(update={"max_steps": steps})

    @property
    def optim(self) -> OptimizerParams:
        """The optimizer settings (`max_steps` must be known: see `steps_for`)."""
        return OptimizerParams(
            optimizer=self.optimizer, learning_rate=self.learning_rate, max_steps=self.max_steps,
            warmup_steps=self.warmup_steps, schedule=self.schedule, weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )


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

    @model_validator(mode="after")
    def _limit(self):
        if isinstance(self.limit, float) and self.limit >= 1 and not self.limit.is_integer():
            raise ValueError(f"limit {self.limit}: a whole number of documents, or a fraction below 1")
        return self


class EvaluateParams(Strict):
    num_prompts: int = Field(16, ge=0, description="held-out prompts to generate for")
    # the eval loss's forward pass over every row (and a 262k-word output layer) can cost more than
    # generating: a CPU run measures it on the first rows only
    loss_rows: int | None = Field(None, gt=0, description="eval token rows the eval loss covers; null: all")
    max_new_tokens: int = Field(48, gt=0)
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
    harness: HarnessParams = HarnessParams()

    @model_validator(mode="after")
    def _sampling(self):
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError("num_samples > 1 needs temperature > 0 (greedy samples are all the same)")
        if (self.top_p is not None or self.top_k is not None) and self.temperature == 0:
            raise ValueError("top_p / top_k need temperature > 0 (temperature 0 is greedy)")
        return self


class RewardParams(Strict):
    """One GRPO reward: a built-in name or `package.module:function`, weighted in the total."""

    # built-in: format_exact, format_approx, answer, length_penalty;
    # custom: "package.module:function" with signature (prompts, completions, **columns) -> list[float]
    fn: str
    weight: float = 1.0
    name: str | None = Field(None, description="label in metrics; default: the function's name")
    kwargs: dict = Field({}, description="extra keyword arguments for the function")


class GrpoParams(Strict):
    """GRPO polish from the SFT checkpoint with Tunix's RLCluster + GRPOLearner (vanilla rollout)."""

    enabled: bool = True
    loss_variant: Literal["grpo", "dr-grpo", "dapo"] = "grpo"
    max_steps: int = Field(gt=0)
    batch_size: int = Field(2, gt=0, description="prompts per step (x num_generations completions)")
    # a small fixed pool seen in epochs: later steps revisit earlier prompts, so the reward's trend
    # is the policy's and not which prompts a step drew
    max_prompts: int | None = Field(None, gt=0, description="train on a seeded sample of this many prompts; null: all")
    num_generations: int = Field(4, ge=2, description="completions per prompt (G)")
    # Tunix's micro-batches: generation, log-probs and gradient accumulation over this many prompts at
    # a time, one optimizer update per step, so memory follows the micro-batch, not the group size
    micro_batch_size: int | None = Field(
        None, gt=0, description="prompts per micro-batch (x num_generations completions); null: the whole batch"
    )
    num_iterations: int = Field(1, ge=1, description="policy updates per batch of rollouts (mu)")
    beta: float = Field(0.04, ge=0, description="KL weight to the frozen SFT reference; 0: no reference model")
    epsilon: float = Field(0.2, gt=0, description="clipping epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="dapo only: upper clip (default 0.28)")
    max_prompt_length: int = Field(128, gt=0, description="longer prompts are skipped and counted")
    max_completion_length: int = Field(64, gt=0)
    temperature: float = Field(0.9, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    checkpoint_dir: str = "data/06_models/grpo_checkpoints"  # a local folder or a gs://bucket/path URI
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(3, gt=0)
    seed: int = 0
    rewards: list[RewardParams] = Field(
        [
            RewardParams(fn="format_exact", weight=1.0),
            RewardParams(fn="format_approx", weight=0.5),
            RewardParams(fn="answer", weight=2.0, kwargs={"tolerance": 1e-6}),
        ],
        min_length=1,
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps})")
        if self.max_prompts is not None and self.max_prompts < self.batch_size:
            raise ValueError(f"max_prompts ({self.max_prompts}) cannot fill one batch of batch_size ({self.batch_size})")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide batch_size ({self.batch_size}): "
                "use a divisor of it, or null for the whole batch at once"
            )
        if self.epsilon_high is not None and self.loss_variant != "dapo":
            raise ValueError("epsilon_high is a dapo setting; set loss_variant: dapo or remove it")
        if self.loss_variant == "dapo" and self.beta != 0:
            raise ValueError("dapo has no KL term: set beta: 0")
        names = [r.name or r.fn.rsplit(":", 1)[-1] for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique (set `name:`), got {names}")
        return self

    @property
    def optim(self) -> OptimizerParams:
        """AdamW; with warmup, cosine decay to 10% of the peak over max_steps, else a constant rate."""
        return OptimizerParams(
            learning_rate=self.learning_rate, max_steps=self.max_steps, warmup_steps=self.warmup_steps,
            schedule="cosine" if self.warmup_steps else "constant", weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )


class PairsFromRewardsParams(Strict):
    """`pairs: from_rewards`: k samples per training prompt from the SFT model, scored with GRPO's rewards."""

    max_prompts: int = Field(64, gt=0, description="training prompts to sample for (generation-bound: cap it)")
    eval_prompts: int = Field(16, ge=0, description="eval-split prompts to build held-out pairs from")
    num_samples: int = Field(4, ge=2, description="completions per prompt (k)")
    temperature: float = Field(1.0, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    batch_size: int = Field(8, gt=0, description="sequences per generation call")
    margin: float = Field(0.5, ge=0, description="keep best/worst only where their total rewards differ by this")
    seed: int = 0
    # null: grpo.rewards (the same functions and weights GRPO optimises)
    rewards: list[RewardParams] | None = None


class PreferenceParams(Strict):
    """Preference polish after SFT (and before GRPO) on Tunix's DPOTrainer: DPO, ORPO or SimPO."""

    enabled: bool = False
    method: Literal["dpo", "orpo", "simpo"] = "dpo"
    # from_data: `data.sources` in format `preference`; from_rewards: sampled from the SFT model
    pairs: Literal["from_data", "from_rewards"] = "from_rewards"
    data: IngestParams | None = None
    from_rewards: PairsFromRewardsParams = PairsFromRewardsParams()
    beta: float = Field(0.1, gt=0, description="dpo: KL strength; simpo: reward scale; orpo: unused")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="conservative DPO / robust labels (all three)")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: weight of the odds-ratio term")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: target reward margin (gamma, as in the paper)")
    # RPO: + sft_weight x NLL of the chosen answer (per-token mean); orpo has its own SFT term
    sft_weight: float = Field(0.0, ge=0)
    # dpo: the reference log-probabilities in one pass before training, so no reference model is held
    precompute_reference: bool = False
    max_prompt_length: int = Field(128, gt=0, description="tokens, left-padded; longer pairs are dropped and counted")
    max_response_length: int = Field(64, gt=0, description="tokens, right-padded; longer pairs are dropped and counted")
    per_device_batch_size: int = Field(2, gt=0, description="pairs per data-parallel device")
    max_steps: int = Field(20, gt=0)
    learning_rate: float = Field(5e-6, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float | None = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    checkpoint_dir: str = "data/06_models/preference_checkpoints"  # a local folder or a gs://bucket/path URI
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    time_budget_hours: float | None = Field(None, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps})")
        if self.pairs == "from_data" and self.data is None:
            raise ValueError("pairs: from_data needs `preference.data.sources` (format: preference)")
        if self.data is not None:
            formats = {s.format for s in self.data.sources}
            if formats != {"preference"}:
                raise ValueError(f"preference.data.sources must all have format: preference, got {sorted(formats)}")
        if self.method == "orpo" and self.sft_weight:
            raise ValueError("orpo has its own SFT term (weight 1): set sft_weight: 0, or use dpo/simpo with sft_weight")
        if self.pairs == "from_rewards" and self.from_rewards.max_new_tokens >= self.max_response_length:
            raise ValueError(
                f"from_rewards.max_new_tokens ({self.from_rewards.max_new_tokens}) must be below max_response_length "
                f"({self.max_response_length}): a sample and its end-of-turn must fit, or every pair is dropped"
            )
        if self.precompute_reference and self.method != "dpo":
            raise ValueError(f"precompute_reference is for dpo; {self.method} has no reference model")
        return self

    def as_sft(self):
        """The optimizer/schedule fields as an `SftParams`, to build the optimizer with SFT's own helper."""
        return SftParams(
            max_steps=self.max_steps, per_device_batch_size=self.per_device_batch_size,
            learning_rate=self.learning_rate, warmup_steps=self.warmup_steps, schedule=self.schedule,
            max_grad_norm=self.max_grad_norm, weight_decay=self.weight_decay, checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep_checkpoints,
            time_budget_hours=self.time_budget_hours, seed=self.seed,
        )


class ExportParams(Strict):
    output_dir: str = "data/06_models/exported"  # a local folder or a gs://bucket/path URI
    max_shard_size: str = "2GB"
    # hf: the Hugging Face folder (always: the other stages and vLLM read it); gguf: also GGUF files and an
    # Ollama Modelfile in gguf_dir, one file per type in gguf_types
    formats: list[Literal["hf", "gguf"]] = ["hf"]
    gguf_dir: str = "data/06_models/gguf"  # a local folder or a gs://bucket/path URI
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


# ---------------------------------------------------------------- plan (preflight: memory, time, cost)
class HardwareProfile(Strict):
    """One machine to rent (or a free notebook session). Figures are per device, as JAX counts devices."""

    kind: Literal["cpu", "gpu", "tpu"]
    devices: int = Field(gt=0)
    hosts: int = Field(1, gt=0)
    memory_gib: float = Field(gt=0, description="memory per device")
    peak_tflops: float = Field(gt=0, description="dense bf16 TFLOP/s per device")
    cost_per_hour: float | None = Field(None, ge=0, description="USD/hour, whole machine, on demand")
    preemptible_cost_per_hour: float | None = Field(None, ge=0, description="USD/hour, spot/preemptible")
    session_hours: float | None = Field(None, gt=0, description="a session ends after this (Kaggle: 9)")
    weekly_hours: float | None = Field(None, gt=0, description="quota per week (Kaggle TPU: 20)")
    mfu: float | None = Field(None, gt=0, le=1, description="assumed MFU on this hardware; overrides plan.mfu")
    mfu_source: str = ""  # where the assumed MFU comes from (a published benchmark, a seed, a measurement)
    # a TPU's topology as libtpu names it (e.g. v5e:2x4, v4:4x4x2): the plan compiles the train step for it
    topology: str | None = None
    # decoding (GRPO's rollouts) reads every weight and the KV cache for each token: HBM bandwidth bounds it
    hbm_gb_per_s: float | None = Field(None, gt=0, description="memory bandwidth per device (GB/s)")
    hbm_source: str = ""  # the spec sheet it comes from
    decode_utilisation: float | None = Field(
        None, gt=0, le=1, description="assumed share of hbm_gb_per_s a decode step reaches; overrides plan's"
    )
    decode_source: str = ""  # where the assumed decode utilisation comes from

    @model_validator(mode="after")
    def _topology_has_the_devices(self):
        if self.topology is None:
            return self
        m = re.fullmatch(r"(v2|v3|v4|v5e|v5p|v6e|tpu7x):(\d+(?:x\d+){1,2})", self.topology)
        if self.kind != "tpu" or not m:
            raise ValueError(
                f"topology {self.topology!r}: a TPU profile's chip generation and chip grid as libtpu names them, "
                "e.g. v5e:2x4 (8 chips), v4:4x4x2 (32 chips), v5p:2x2x1, v6e:2x4"
            )
        chips = math.prod(int(x) for x in m.group(2).split("x"))
        per_chip = 2 if m.group(1) in ("v2", "v3", "tpu7x") else 1  # JAX's devices per chip (v4/v5p: megacore)
        if chips * per_chip != self.devices:
            raise ValueError(f"topology {self.topology} has {chips * per_chip} JAX devices, the profile says devices: {self.devices}")
        return self
    setup_minutes: float | None = Field(None, ge=0, description="overrides plan.session_setup_minutes")
    note: str = ""


class PlanBudget(Strict):
    max_cost: float | None = Field(None, ge=0, description="USD for the whole run")
    max_hours: float | None = Field(None, gt=0, description="wall-clock hours for the whole run")
    preemptible: bool = False  # price at the preemptible rate where a profile has one


class XlaCheckParams(Strict):
    """Compile the train step ahead of time (abstract shapes, no weights): for the TPU topology of the
    selected profile when libtpu is installed, else on a fake CPU mesh."""

    enabled: bool = True
    # deeper models are compiled at one and two layer periods (XLA:TPU: two and three) and extrapolated; null: every layer
    max_layers: int | None = Field(4, gt=0)
    timeout_seconds: int = Field(900, gt=0)
    grpo: bool = True  # also compile GRPO's decode step and policy update (XLA:TPU only) when GRPO is planned


class PlanParams(Strict):
    enabled: bool = True  # the sft pipeline runs the plan first and stops a run that cannot fit
    hardware: str = "auto"  # a profile name, or auto: the devices JAX sees
    mfu: float = Field(0.47, gt=0, le=1, description="assumed model FLOP utilisation")
    # decoding (pair building, GRPO rollouts) reads every weight per token of a batch: far below training's MFU
    generation_mfu: float = Field(0.05, gt=0, le=1, description="assumed FLOP utilisation while generating")
    # GRPO's rollouts: a decode step's time is the bytes it reads (weights, KV cache) over this share of HBM bandwidth
    decode_utilisation: float = Field(0.5, gt=0, le=1, description="assumed share of HBM bandwidth while decoding")
    checkpoint_seconds: float | None = Field(None, ge=0, description="null: checkpoint bytes / checkpoint_gb_per_s")
    checkpoint_gb_per_s: float = Field(0.5, gt=0)
    session_setup_minutes: float = Field(30.0, ge=0, description="per session: install, load, compile")
    usable_memory_fraction: float = Field(0.95, gt=0, le=1)
    warn_memory_fraction: float = Field(0.9, gt=0, le=1)
    large_model_params: float = Field(1.0e9, gt=0, description="seed 004: warn for models this big on small GPUs")
    small_gpu_gib: float = Field(24.0, gt=0)
    train_rows: int | None = Field(None, gt=0, description="to report epochs when the data is not at hand")
    budget: PlanBudget = PlanBudget()
    xla_check: XlaCheckParams = XlaCheckParams()
    profiles: dict[str, HardwareProfile] = Field(min_length=1)
    # hub id -> its config.json, for models not downloaded yet
    architectures: dict[str, dict]  # no default: conf/base holds the table

    @model_validator(mode="after")
    def _known_hardware(self):
        if self.hardware != "auto" and self.hardware not in self.profiles:
            raise ValueError(f"plan.hardware {self.hardware!r} is not a profile; choose auto or one of {sorted(self.profiles)}")
        return self
