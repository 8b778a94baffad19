"""The training job as configured, independent of the hardware, and its train step on a hardware profile."""

from __future__ import annotations

import dataclasses
import math

from tunix_pipeline.config import HardwareProfile, ModelParams, RuntimeParams, SftParams
from tunix_pipeline.models.architecture import Architecture, PlanError, lora_targets
from tunix_pipeline.planning.goodput import Padding
from tunix_pipeline.planning.memory import TrainSetup


@dataclasses.dataclass(frozen=True)
class Job:
    """The training job, independent of the hardware it runs on."""

    arch: Architecture
    seq_len: int
    per_device_batch: int
    global_batch: int  # rows per optimizer step, as configured
    max_steps: int
    checkpoint_every: int
    param_dtype: str
    compute_dtype: str | None
    mode: str  # full | lora | qlora
    lora_rank: int
    lora_targets: tuple[str, ...]
    optimizer: str
    mu_dtype: str | None
    remat: str
    loss_chunk: int | None
    tp: int  # tensor-parallel size asked for (1: data/fsdp only)
    mesh: dict | None  # the configured mesh when explicit
    train_rows: int | None = None
    time_budget_hours: float | None = None  # sft.time_budget_hours: a session budget on any hardware
    pack: bool = False  # tokenize.pack: several examples a row
    train_examples: int | None = None  # plan.train_examples: the examples packed into train_rows
    padding: Padding | None = None  # the training rows' padding (the tokenize report), when known
    padding_note: str | None = None  # why it is not known
    precision: dict | None = None  # the share of the trained weights a step can change (planning.precision)

    @property
    def samples(self) -> int:
        return self.max_steps * self.global_batch

    def flops_per_step(self, global_batch: int, remat: str) -> float:
        """Analytic FLOPs of one optimizer step of `global_batch` rows."""
        mode = "full" if self.mode == "full" else "lora"
        return global_batch * self.seq_len * self.arch.train_flops_per_token(self.seq_len, mode, remat)


def make_job(arch: Architecture, model: ModelParams, sft: SftParams, runtime: RuntimeParams,
             seq_len: int, devices: int, train_rows: int | None = None) -> Job:
    """The job as configured, on `devices` devices (those of the selected hardware)."""
    mesh = runtime.mesh if isinstance(runtime.mesh, dict) else None
    tp = (mesh or {}).get("tp", 1)
    data_parallel = devices // tp if mesh is None or _mesh_size(mesh) != devices else _mesh_size(mesh) // tp
    mode = "full" if model.lora is None else ("qlora" if model.lora.quantize else "lora")
    micro_batch = sft.per_device_batch_size * max(data_parallel, 1)
    if sft.epochs is not None:
        if not train_rows:
            raise PlanError(
                f"sft.epochs: {sft.epochs:g} needs the number of training rows to plan the steps: set "
                "plan.train_rows (the sft preflight counts the tokenized rows itself)"
            )
        try:
            sft = sft.steps_for(train_rows, micro_batch)
        except ValueError as err:
            raise PlanError(str(err)) from None
    return Job(
        arch=arch,
        seq_len=seq_len,
        per_device_batch=sft.per_device_batch_size,
        global_batch=micro_batch * sft.gradient_accumulation_steps,
        max_steps=sft.max_steps,
        checkpoint_every=sft.checkpoint_every,
        param_dtype=model.dtype,
        compute_dtype=sft.compute_dtype,
        mode=mode,
        lora_rank=model.lora.rank if model.lora else 16,
        lora_targets=lora_targets(model.lora.target_modules) if model.lora else (),
        optimizer=sft.optimizer,
        mu_dtype=sft.mu_dtype,
        remat=sft.remat,
        loss_chunk=sft.loss_chunk_size,
        tp=tp,
        mesh=dict(mesh) if mesh else None,
        train_rows=train_rows,
        time_budget_hours=sft.time_budget_hours,
    )


def _mesh_size(mesh: dict) -> int:
    return math.prod(mesh.values())


def setup_on(job: Job, hw: HardwareProfile, per_device_batch: int | None = None) -> tuple[TrainSetup, int]:
    """(the job's train step on this hardware, its global batch): the configured mesh when it
    has this many devices, else all devices on fsdp (tp kept when it divides); the configured
    global batch is kept by gradient accumulation where the hardware has fewer data-parallel devices."""
    if job.mesh and _mesh_size(job.mesh) == hw.devices:
        data, fsdp, tp = job.mesh.get("data", 1), job.mesh.get("fsdp", 1), job.mesh.get("tp", 1)
    else:
        tp = job.tp if hw.devices % job.tp == 0 else 1
        data, fsdp = 1, hw.devices // tp
    dp = data * fsdp
    micro = per_device_batch or job.per_device_batch
    micro = max(1, min(micro, math.ceil(job.global_batch / dp)))
    accum = max(1, round(job.global_batch / (micro * dp)))
    setup = TrainSetup(
        per_device_batch=micro,
        seq_len=job.seq_len,
        data=data,
        fsdp=fsdp,
        tp=tp,
        param_dtype=job.param_dtype,
        compute_dtype=job.compute_dtype,
        backend=hw.kind,
        mode=job.mode,
        lora_rank=job.lora_rank,
        lora_targets=job.lora_targets or TrainSetup.lora_targets,
        optimizer=job.optimizer,
        mu_dtype=job.mu_dtype,
        grad_accum=accum,
        remat=job.remat,
        loss_chunk=job.loss_chunk,
    )
    return setup, micro * dp * accum
