"""A finished session's final weights, copied under the output root for the next session.

A recipe may keep its checkpoints on a scratch folder outside the output root (Kaggle:
/kaggle/temp, beside the 20 GB of /kaggle/working that a notebook saves): the session
resumes exactly from them while it runs (weights, optimizer state, data position), and
only what the next session starts from is saved: the trained weights of the step it
starts from (only the adapters in a LoRA run), without the optimizer state (a new session
starts a fresh optimizer: `checkpoints.start_from`), with the histories beside them.
Gemma-2B in bf16: 5.0 GB instead of a 15 GB checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from etils import epath

from tunix_pipeline.core.paths import is_uri
from tunix_pipeline.stages import POLISH, SFT
from tunix_pipeline.train.checkpoints import dev_selected_step

log = logging.getLogger(__name__)
FOLDER = "06_models/final_weights"  # under the output root (planning.disk counts it there)
# what a restore of the weights reads in a step's folder (Tunix's CheckpointManager, optimizer left out); every
# JSON file beside the steps comes too: the stage's history, dev curve and MLflow lineage
STEP_FILES = ("model_params", "_CHECKPOINT_METADATA", "commit_success.txt")


def copy_final_weights(checkpoint_dir: str | Path, step: int, destination: str | Path) -> Path:
    """`<checkpoint_dir>/<step>`'s weights (no optimizer state) and the files beside the steps, into
    `<destination>/<step>`: a checkpoint folder `checkpoints.restore_latest` / `start_from` read as any other."""
    source, target = Path(checkpoint_dir), Path(destination)
    step_dir = source / str(step)
    if not (step_dir / "model_params").is_dir():
        raise FileNotFoundError(f"no weights at {step_dir}/model_params to keep for the next session")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name in STEP_FILES:
        src = step_dir / name
        if src.is_dir():
            shutil.copytree(src, tmp / str(step) / name)
        elif src.is_file():
            (tmp / str(step)).mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / str(step) / name)
    for side in source.glob("*.json"):
        shutil.copy2(side, tmp / side.name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # whole or not at all: a next session never reads a half copy
    return target


def keep_for_next_session(entry: dict, output_root: str, session: str) -> dict:
    """The ledger entry of a finished session, its next session's checkpoint (the last stage trained: GRPO,
    preference, else SFT, as `sessions._parent` picks it) copied under a local output root when it lies outside it
    (a scratch folder), the entry pointing at the copy. Unchanged for a URI root or a checkpoint already under it."""
    prefix = next((f"{s.name}_" for s in reversed(POLISH) if entry.get(f"{s.name}_checkpoint_dir")), "")
    folder, step = entry.get(f"{prefix}checkpoint_dir"), entry.get(f"{prefix}step")
    if not folder or step is None or is_uri(output_root) or is_uri(folder):
        return entry
    root = Path(output_root).resolve()
    if Path(folder).resolve().is_relative_to(root):
        return entry

    step = dev_selected_step(epath.Path(Path(folder).resolve())) or step  # the step the next session starts from
    stage = prefix.rstrip("_") or SFT.name
    target = copy_final_weights(folder, step, root / FOLDER / session / stage)
    log.info("session '%s': %s step %d's weights copied from %s to %s for the next session (no optimizer state)",
             session, stage, step, folder, target)
    return {**entry, f"{prefix}checkpoint_dir": str(target), f"{prefix}step": step,
            f"{prefix}scratch_checkpoint_dir": folder}
