"""Settings of the run and SFT: `runtime` (devices, mesh, multi-host), the optimizer and checkpoint keys every
training stage's section has, `sft`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tunix_pipeline.config.base import Location, Strict

# completion positions per row in each chunk of the output layer: [batch, 128, vocabulary] float32 logits at a
# time (Gemma's 262k words: 128 MiB a row), few enough chunks that a row's last one is mostly full
DEFAULT_LOSS_CHUNK = 128


class DistributedParams(Strict):
    """Arguments of `jax.distributed.initialize` (one process per host)."""

    coordinator_address: str
    num_processes: int = Field(gt=0)
    process_id: int = Field(ge=0)


class RuntimeParams(Strict):
    # the folder every output goes under (the catalog reads the same value through globals/runtime_params);
    # the checkpoints, sessions ledger and export under it also accept a gs://bucket/path URI (`gcs` extra)
    output_root: Location = "data"
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
    # generation (evaluation, preference pairs, GRPO's rollouts) decodes with the weights split as trained, or
    # gathered whole on each data-parallel device once a call (no collective a token; left sharded, with a warning,
    # where that copy would take over half a device's free memory). Which is faster depends on how XLA splits the
    # decode step (`plan` compiles it for a TPU): over fsdp it gathers Gemma-2-2B's every layer at every token, but
    # splits Gemma-3-1B's matmuls
    decode_weights: Literal["sharded", "gathered"] = "sharded"


class OptimizerSettings(Strict):
    """The optimizer and its learning-rate schedule: keys every training stage's section has (SFT, preference,
    GRPO), built by `optim.make_optimizer`. A stage gives `learning_rate` its own default (SFT: none)."""

    optimizer: Literal["adamw", "adafactor"] = "adamw"
    learning_rate: float = Field(gt=0)
    # linear warmup from 0, then cosine decay (to 10% of the peak), linear (to 0) or constant
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # decoupled weight decay on matrices only (not norms or biases)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    # AdamW's first moment in bf16 (MaxText's mu_dtype; the second stays in the weights' dtype): with float32
    # masters a checkpoint's optimizer state goes from 8 to 6 bytes a weight
    mu_dtype: Literal["bfloat16"] | None = None

    @model_validator(mode="after")
    def _mu_dtype_is_adams(self):
        if self.mu_dtype and self.optimizer != "adamw":
            raise ValueError(f"mu_dtype is AdamW's first moment; {self.optimizer} keeps none: drop mu_dtype")
        return self


class CheckpointSettings(Strict):
    """Where and how often a training stage saves its Orbax checkpoints (and resumes from the latest good one).
    A stage gives `checkpoint_dir` its own default."""

    checkpoint_dir: Location  # a local folder or a gs://bucket/path URI
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(3, gt=0)


class DevEvalParams(Strict):
    """Greedy generation on the first `prompts` dev rows of the eval split every `every` steps (and at the last),
    scored as `evaluate` scores (lenient and strict accuracy, format): the curve goes to MLflow as `dev/*`, and the
    step with the best lenient accuracy is kept through checkpoint pruning and is the one the later stages use."""

    every: int = Field(gt=0)
    prompts: int = Field(16, gt=0, description="the first this many dev rows of eval_formatted")
    max_new_tokens: int = Field(128, gt=0)
    batch_size: int = Field(8, gt=0, description="sequences per generation call")


class SftParams(OptimizerSettings, CheckpointSettings):
    # 0 only with init_from: no training this session, the parent checkpoint passes on (e.g. to GRPO);
    # null with `epochs`: the steps follow from the training rows
    max_steps: int | None = Field(ge=0)
    # passes over the training rows instead of max_steps (set max_steps: null); the trainer turns it into
    # optimizer steps once the rows are known (`steps_for`), the plan from plan.train_rows
    epochs: float | None = Field(None, gt=0)
    per_device_batch_size: int = Field(gt=0)
    # optimizer steps average this many micro-batches (global batch = per-device x data devices x this)
    gradient_accumulation_steps: int = Field(1, gt=0)
    # bfloat16: compute in bf16 while the weights (and optimizer) stay in model.dtype, e.g. fp32 masters
    compute_dtype: Literal["bfloat16"] | None = None
    # activation rematerialisation: none, attention (each attention block), decoder (each whole layer)
    remat: Literal["none", "attention", "decoder"] = "none"
    # the output layer and cross-entropy run over this many completion positions of every row at a time
    loss_chunk_size: int = Field(DEFAULT_LOSS_CHUNK, gt=0)
    checkpoint_dir: Location = "data/06_models/sft_checkpoints"
    checkpoint_every: int = Field(gt=0)
    eval_every: int | None = Field(None, gt=0)
    # score the dev split every N steps and keep the best step by lenient accuracy (`DevEvalParams`); null: off,
    # the latest checkpoint is the result
    dev_eval: DevEvalParams | None = None
    # stop early enough to save a checkpoint before this many hours pass since the process started
    # (Kaggle sessions: 9); null: no limit
    time_budget_hours: float | None = Field(None, gt=0)
    seed: int = 0
    # start from another run's checkpoint folder (full or LoRA, its latest step): its weights, with this
    # run's data, a fresh optimizer and step 0. Not a resume: an interrupted run resumes from checkpoint_dir.
    init_from: Location | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_training_needs_no_epochs(cls, data):
        # `max_steps: 0` (a session that only passes its parent on) overrides a recipe that trains by epochs
        if isinstance(data, dict) and data.get("max_steps") == 0:
            return {**data, "epochs": None}
        return data

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
