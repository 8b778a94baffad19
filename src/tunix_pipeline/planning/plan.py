"""The plan: memory, step time, session fit and cost of an SFT run on every hardware profile.

Plain Python (no Kedro): `make_plan(...)` takes the project's parameter
models and returns a `Plan`; `planning.report` renders it, the `plan` and `sft`
pipelines call it.
"""

from __future__ import annotations

import dataclasses
import math

from tunix_pipeline.config import HardwareProfile, PlanParams
from tunix_pipeline.models.architecture import PlanError
from tunix_pipeline.planning.disk import disk_summary
from tunix_pipeline.planning.goodput import summary as goodput_summary
from tunix_pipeline.planning.job import Job, setup_on
from tunix_pipeline.planning.memory import GIB, MemoryEstimate, TrainSetup, checkpoint_bytes, estimate_memory
from tunix_pipeline.stages import SFT


class DoesNotFit(PlanError):
    """The configured run needs more memory per device than the hardware has."""


@dataclasses.dataclass(frozen=True)
class Row:
    """The job on one hardware profile."""

    profile: str
    hw: HardwareProfile
    setup: TrainSetup
    memory: MemoryEstimate
    usable_bytes: float
    steps: int
    global_batch: int
    step_seconds: float
    samples_per_hour: float
    checkpoint_seconds: float
    steps_per_session: int | None
    sessions: int
    hours: float
    weeks: int | None
    cost: float | None
    preemptible_cost: float | None
    within_budget: bool
    notes: tuple[str, ...] = ()
    compiled_peak: float | None = None  # memory_analysis() of this very step, when its compiler compiled it
    compiled_flops: float | None = None  # its cost_analysis() FLOPs per optimizer step, all devices
    compiled_by: str | None = None  # that compiler: XLA:TPU, or XLA:CPU for this CPU
    mfu: float = 0.0  # the assumed MFU the step time rests on

    @property
    def peak(self) -> float:
        """Bytes per device: the compiled program's when there is one, else the estimate."""
        return self.compiled_peak if self.compiled_peak is not None else self.memory.peak

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable_bytes

    @property
    def memory_fraction(self) -> float:
        return self.peak / self.usable_bytes


@dataclasses.dataclass
class Plan:
    job: Job
    rows: list[Row]
    selected: Row
    recommended: Row | None
    status: str  # ok | risky | over
    warnings: list[str]
    advice: list[str]  # what would make the selected run fit
    headroom: list[str] = dataclasses.field(default_factory=list)  # what the memory a fitting run leaves would hold
    xla: dict | None = None  # the XLA check, when run
    assumptions: dict = dataclasses.field(default_factory=dict)
    # each polish stage that is on, by name: its figures on every profile (`planning.<stage>.add_<stage>`)
    polish: dict[str, dict] = dataclasses.field(default_factory=dict)
    goodput: dict = dataclasses.field(default_factory=dict)  # useful tokens, examples, epochs (planning.goodput)
    disk: dict | None = None  # bytes of every output against the profile's volumes (planning.disk; add_disk)
    scoring: dict | None = None  # the evaluation's and the dev evaluation's memory (planning.scoring; add_scoring)

    def summary(self) -> dict:
        s = self.selected
        out = {
            "status": self.status,
            "hardware": s.profile,
            "model": self.job.arch.name,
            "mode": self.job.mode,
            "params": self.job.arch.params,
            "trainable_params": s.memory.trainable_params,
            "sequence_length": self.job.seq_len,
            "global_batch": s.global_batch,
            "per_device_batch": s.setup.per_device_batch,
            "gradient_accumulation": s.setup.grad_accum,
            "mesh": s.setup.mesh,
            "memory_per_device_gib": round(s.peak / GIB, 3),
            "memory_from": s.compiled_by if s.compiled_peak is not None else "estimate",
            "estimated_memory_per_device_gib": round(s.memory.peak / GIB, 3),
            "usable_memory_gib": round(s.usable_bytes / GIB, 3),
            "process_peak_gib": process_peak_gib(s.hw, s.peak),
            "memory_fraction": round(s.memory_fraction, 4),
            "memory": s.memory.as_dict(),
            "step_seconds": s.step_seconds,
            "flops_per_step": s.compiled_flops or self.job.flops_per_step(s.global_batch, s.setup.remat),
            "flops_from": s.compiled_by if s.compiled_flops is not None else "estimate",
            "mfu": s.mfu,
            "samples_per_hour": s.samples_per_hour,  # rows of sequence_length tokens, padding included
            "goodput": self.goodput,
            "steps": s.steps,
            "steps_per_session": s.steps_per_session,
            "sessions": s.sessions,
            "hours": s.hours,
            "cost": s.cost,
            "preemptible_cost": s.preemptible_cost,
            "recommended": self.recommended.profile if self.recommended else None,
            "recommended_cost": self.recommended.cost if self.recommended else None,
            "recommended_hours": self.recommended.hours if self.recommended else None,
            "warnings": list(self.warnings),
            "advice": list(self.advice),
            "headroom": list(self.headroom),
            "update_precision": self.job.precision,
            "assumptions": self.assumptions,
            "profiles": {
                r.profile: {
                    "fits": r.fits,
                    "memory_per_device_gib": round(r.peak / GIB, 3),
                    "memory_gib": r.hw.memory_gib,
                    "devices": r.hw.devices,
                    "hours": r.hours,
                    "cost": r.cost,
                    "sessions": r.sessions,
                    "within_budget": r.within_budget,
                }
                for r in self.rows
            },
        }
        if self.xla:
            out["xla_check"] = self.xla
        for name, section in self.polish.items():
            out[name] = {k: v for k, v in section.items() if k != "params"}
        if self.polish:
            out["stages"] = self.stages()
        if self.disk:
            out["disk"] = disk_summary(self.disk)
        if self.scoring:
            out["scoring"] = self.scoring
        return out

    def stages(self) -> dict:
        """Hours and cost of every planned stage on the selected hardware, and their total."""
        s = self.selected
        hours = {SFT.name: s.hours if self.job.max_steps else 0.0}
        hours.update({name: section["selected"]["hours"] for name, section in self.polish.items()})
        known = [h for h in hours.values() if h is not None]
        total = sum(known) if len(known) == len(hours) else None
        return {"hours": hours, "total_hours": total,
                "total_cost": total * s.hw.cost_per_hour if total is not None and s.hw.cost_per_hour is not None else None}


# ---------------------------------------------------------------- one profile
def evaluate(job: Job, name: str, hw: HardwareProfile, plan: PlanParams, setup: TrainSetup | None = None,
             compiled: dict | None = None) -> Row:
    """The job on `hw`; `compiled`: its compiler's figures for this very setup (`check_against_xla`), used
    in place of the estimate's memory and FLOPs."""
    if setup is None:
        setup, global_batch = setup_on(job, hw)
    else:
        global_batch = setup.per_device_batch * setup.data * setup.fsdp * setup.grad_accum
    mem = estimate_memory(job.arch, setup)
    usable = hw.memory_gib * GIB * plan.usable_memory_fraction
    mfu = hw.mfu or plan.mfu
    steps = max(1, math.ceil(job.samples / global_batch))
    compiled_peak = compiled_flops = None
    if compiled:
        compiled_peak = compiled["xla_gib"] * GIB
        # the compiled step is one micro-batch on every device; an optimizer step is grad_accum of them
        compiled_flops = compiled["flops_per_device"] * setup.devices * setup.grad_accum if compiled.get("flops_per_device") else None
    flops = compiled_flops or job.flops_per_step(global_batch, setup.remat)
    step_seconds = flops / (hw.devices * hw.peak_tflops * 1e12 * mfu)
    samples_per_hour = global_batch * 3600 / step_seconds
    ckpt = plan.checkpoint_seconds
    if ckpt is None:
        ckpt = checkpoint_bytes(job.arch, setup) / (plan.checkpoint_gb_per_s * 1e9)
    every = _checkpoint_interval(job, global_batch)
    steps_per_session, sessions, hours, notes = _sessions(job, hw, plan, steps, step_seconds, ckpt, every)
    weeks = math.ceil(hours / hw.weekly_hours) if hw.weekly_hours else None
    cost = hours * hw.cost_per_hour if hw.cost_per_hour is not None else None
    pcost = hours * hw.preemptible_cost_per_hour if hw.preemptible_cost_per_hour is not None else None
    price = pcost if plan.budget.preemptible and pcost is not None else cost
    within = (sessions > 0) and (plan.budget.max_cost is None or (price is not None and price <= plan.budget.max_cost)) and (
        plan.budget.max_hours is None or hours <= plan.budget.max_hours
    )
    if global_batch != job.global_batch:
        notes.append(f"global batch {global_batch} (configured {job.global_batch})")
    if setup.grad_accum > 1:
        notes.append(f"gradient accumulation {setup.grad_accum}")
    return Row(
        profile=name,
        hw=hw,
        setup=setup,
        memory=mem,
        usable_bytes=usable,
        steps=steps,
        global_batch=global_batch,
        step_seconds=step_seconds,
        samples_per_hour=samples_per_hour,
        checkpoint_seconds=ckpt,
        steps_per_session=steps_per_session,
        sessions=sessions,
        hours=hours,
        weeks=weeks,
        cost=cost,
        preemptible_cost=pcost,
        within_budget=within,
        notes=tuple(notes),
        compiled_peak=compiled_peak,
        compiled_flops=compiled_flops,
        compiled_by=compiled["compiler"] if compiled else None,
        mfu=mfu,
    )


def _checkpoint_interval(job: Job, global_batch: int) -> int:
    """Steps between checkpoints at `global_batch`: the configured interval's samples."""
    return max(1, math.ceil(job.checkpoint_every * job.global_batch / global_batch))


def hours_for_steps(job: Job, row: Row, plan: PlanParams, steps: int) -> float:
    """Hours of `row`'s run had it `steps` optimizer steps: the same step time, checkpoints and sessions."""
    every = _checkpoint_interval(job, row.global_batch)
    return _sessions(job, row.hw, plan, steps, row.step_seconds, row.checkpoint_seconds, every)[2]


def _sessions(job: Job, hw: HardwareProfile, plan: PlanParams, steps: int, step_seconds: float, ckpt: float,
              every: int) -> tuple[int | None, int, float, list[str]]:
    """(steps per session, sessions, hours in all, notes): the run cut into sessions of `hw.session_hours` (or
    `sft.time_budget_hours`), each paying the set-up and ending with a checkpoint save."""
    saves = math.ceil(steps / every)
    setup_seconds = (hw.setup_minutes if hw.setup_minutes is not None else plan.session_setup_minutes) * 60
    notes = []
    steps_per_session = None
    session_hours = min(h for h in (hw.session_hours, job.time_budget_hours, math.inf) if h)
    if session_hours < math.inf:
        usable_session = session_hours * 3600 - setup_seconds - ckpt  # the last save must fit too
        per_step = step_seconds + ckpt / every
        steps_per_session = max(0, int(usable_session // per_step)) if usable_session > 0 else 0
        if steps_per_session and every * step_seconds > usable_session:
            notes.append(f"a {session_hours:g} h session ends before the first checkpoint (every {every} steps)")
        sessions = math.ceil(steps / steps_per_session) if steps_per_session else 0
    else:
        sessions = 1
    seconds = steps * step_seconds + saves * ckpt + max(sessions, 1) * setup_seconds
    return steps_per_session, sessions, seconds / 3600, notes


# ---------------------------------------------------------------- the whole plan
def make_plan(job: Job, plan: PlanParams, selected: tuple[str, HardwareProfile], compiled: dict | None = None) -> Plan:
    """`compiled`: its compiler's figures for the selected run (`check_against_xla`), which it then rests on."""
    name, hw = selected
    rows = [evaluate(job, n, p, plan) for n, p in plan.profiles.items()]
    chosen = evaluate(job, name, hw, plan, compiled=compiled)
    if name in plan.profiles:
        rows = [chosen if r.profile == name else r for r in rows]
    else:
        rows.append(chosen)
    candidates = [r for r in rows if r.fits and r.within_budget and r.sessions > 0]
    recommended = min(candidates, key=lambda r: (_price(r, plan), r.hours)) if candidates else None

    warnings, advice, headroom = [], [], []
    if not chosen.fits:
        status = "over"
        advice = what_would_fit(job, chosen, plan)
    else:
        status = "ok"
        headroom = what_headroom_buys(job, chosen)
        if chosen.memory_fraction > plan.warn_memory_fraction:
            warnings.append(
                f"uses {chosen.memory_fraction:.0%} of the usable memory per device on {name} "
                f"({size(chosen.peak)} of {size(chosen.usable_bytes)}): little headroom, an OOM is possible"
            )
        warnings += [
            n + ": checkpoint more often (sft.checkpoint_every), or set sft.time_budget_hours so the run saves in time"
            for n in chosen.notes if "session ends" in n
        ]
    if hw.kind == "gpu" and job.arch.params >= plan.large_model_params and hw.memory_gib <= plan.small_gpu_gib:
        warnings.append(
            f"large model on a small GPU: {job.arch.name} has {job.arch.params / 1e9:.1f}B parameters and {name} "
            f"has {hw.memory_gib:g} GiB; JAX's allocator and fragmentation make an OOM likely (seed 004)"
        )
    if chosen.sessions == 0:
        warnings.append("not one step fits in a session after set-up and a checkpoint")
    if chosen.setup.data > 1:
        # Tunix's models constrain activations to (fsdp, ..., tp): a `data` axis is gathered, not split
        warnings.append(
            f"runtime.mesh has data: {chosen.setup.data}: Tunix's models split activations over fsdp (and tp) "
            "only, so every device computes all the rows of its data group, using more memory and time than "
            "estimated here; put the data-parallel devices on fsdp instead (runtime.mesh: auto)"
        )
    if status == "ok" and warnings:
        status = "risky"
    useful = goodput_summary(job, chosen, plan.warn_padding_efficiency, lambda n: hours_for_steps(job, chosen, plan, n))
    # after the status: padding costs time and updates lost to rounding cost quality, neither memory
    warnings += [figure["warning"] for figure in (useful, job.precision or {}) if "warning" in figure]
    return Plan(
        job=job,
        rows=rows,
        selected=chosen,
        recommended=recommended,
        status=status,
        warnings=warnings,
        advice=advice,
        headroom=headroom,
        assumptions={
            "mfu": chosen.mfu,
            "mfu_source": hw.mfu_source or "plan.mfu",
            "usable_memory_fraction": plan.usable_memory_fraction,
            "checkpoint_seconds": chosen.checkpoint_seconds,
            "session_setup_minutes": plan.session_setup_minutes,
            "budget": plan.budget.model_dump(),
        },
        goodput=useful,
    )


def process_peak_gib(hw: HardwareProfile, per_device: float) -> float | None:
    """On the CPU the run plans on (`plan.hardware: auto`), the process's resident memory with `per_device` bytes
    on each of its devices: what it held when planned beside its devices' programs; None elsewhere."""
    return round(hw.process_gib + hw.devices * per_device / GIB, 3) if hw.process_gib else None


def _price(row: Row, plan: PlanParams) -> float:
    if plan.budget.preemptible and row.preemptible_cost is not None:
        return row.preemptible_cost
    return row.cost if row.cost is not None else math.inf


def size(x: float) -> str:
    """Bytes as GiB (MiB below one GiB)."""
    return f"{x / GIB:.2f} GiB" if x >= GIB / 2 else f"{x / 2**20:.1f} MiB"


def what_headroom_buys(job: Job, row: Row) -> list[str]:
    """What the memory a fitting run leaves would hold instead, each with its estimate: float32 master weights
    (in bf16 most of a small update rounds away), no remat (a faster step), a larger per-device batch."""
    usable, s = row.usable_bytes, row.setup
    out = []

    def peak(setup):
        return estimate_memory(job.arch, setup).peak

    masters = s.replace(param_dtype="float32", compute_dtype="bfloat16")
    if job.mode == "full" and s.param_dtype == "bfloat16" and peak(masters) <= usable:
        out.append(f"float32 master weights (model.dtype: float32, sft.compute_dtype: bfloat16): {size(peak(masters))}")
    if s.remat != "none" and peak(s.replace(remat="none")) <= usable:
        out.append(f"no remat (sft.remat: none): {size(peak(s.replace(remat='none')))}")
    batches = [b for b in range(s.per_device_batch + 1, 2 * s.per_device_batch + 1)
               if peak(s.replace(per_device_batch=b)) <= usable]
    if batches:
        b = batches[-1]
        out.append(f"per-device batch {b} (sft.per_device_batch_size: {b}): {size(peak(s.replace(per_device_batch=b)))}")
    return out


def what_would_fit(job: Job, row: Row, plan: PlanParams) -> list[str]:
    """Changes that bring the run under the memory of its hardware, each with its estimate."""
    usable = row.usable_bytes
    arch, s = job.arch, row.setup
    out = []

    def peak(setup):
        return estimate_memory(arch, setup).peak

    if job.mode == "full":
        lora = s.replace(mode="lora", lora_targets=TrainSetup.lora_targets)
        if peak(lora) <= usable:
            out.append(f"LoRA (model.lora: {{rank: 16}}): {size(peak(lora))}")
        elif peak(lora.replace(mode="qlora")) <= usable:
            out.append(f"QLoRA (model.lora: {{quantize: nf4}}): {size(peak(lora.replace(mode='qlora')))}")
    for b in range(s.per_device_batch - 1, 0, -1):
        smaller = s.replace(per_device_batch=b, grad_accum=s.grad_accum * s.per_device_batch // b or 1)
        if peak(smaller) <= usable:
            out.append(
                f"per-device batch {b} (sft.per_device_batch_size: {b}, sft.gradient_accumulation_steps: "
                f"{math.ceil(job.global_batch / (b * s.data * s.fsdp))} keeps the global batch): {size(peak(smaller))}"
            )
            break
    length = job.seq_len
    while length > 64:
        length //= 2
        if peak(s.replace(seq_len=length)) <= usable:
            out.append(f"sequences of {length} tokens (tokenize.max_length: {length}): {size(peak(s.replace(seq_len=length)))}")
            break
    for remat in ("attention", "decoder"):
        if s.remat == "none" or (s.remat == "attention" and remat == "decoder"):
            if peak(s.replace(remat=remat)) <= usable:
                out.append(f"remat (sft.remat: {remat}): {size(peak(s.replace(remat=remat)))}")
                break
    if s.loss_chunk and s.loss_chunk > 32 and arch.vocab_size >= 32000 and peak(s.replace(loss_chunk=32)) <= usable:
        out.append(f"smaller loss chunks (sft.loss_chunk_size: 32): {size(peak(s.replace(loss_chunk=32)))}")
    bigger = [
        (n, p) for n, p in plan.profiles.items()
        if p.kind == row.hw.kind and p.devices * p.memory_gib > row.hw.devices * row.hw.memory_gib
        and evaluate(job, n, p, plan).fits
    ]
    if bigger:
        n, p = min(bigger, key=lambda x: (x[1].cost_per_hour if x[1].cost_per_hour is not None else math.inf, x[1].devices))
        out.append(f"more devices or memory: {n} ({p.devices} x {p.memory_gib:g} GiB): {size(evaluate(job, n, p, plan).memory.peak)}")
    return out
