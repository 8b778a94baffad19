"""Where a base model's Hugging Face folder comes from: built, local, the HF hub, or Kaggle."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tunix_pipeline.config import ModelParams
from tunix_pipeline.models.errors import ModelError

HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model"]


def resolve_model_dir(params: ModelParams, corpus: Iterable[str] = ()) -> Path:
    """The folder holding the base model: built (tiny), local, or downloaded."""
    if params.source == "tiny":
        from tunix_pipeline.models.tiny import build_tiny_gemma

        return build_tiny_gemma(params.local_dir, corpus, params.tiny)
    if params.source.startswith("kaggle:"):
        return _download_kaggle(params.source.removeprefix("kaggle:"))
    local = Path(params.source)
    if local.exists():
        check_folder(local)
        return local
    if local.is_absolute() or params.source.startswith((".", "data/")):
        raise ModelError(f"model folder not found: {local}")
    return _download(params.source, params.revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        # HF_TOKEN (or `hf auth login`) authorises gated models such as Gemma.
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except Exception as err:  # offline, gated, or unknown id
        raise ModelError(
            f"could not download '{repo_id}' from the Hugging Face hub: {err}. "
            "For gated models (Gemma) accept the licence on the hub and set HF_TOKEN; "
            "offline, point `model.source` at a downloaded folder."
        ) from err
    folder = Path(path)
    check_folder(folder)
    return folder


def _download_kaggle(handle: str) -> Path:
    """A Kaggle model handle, e.g. `google/gemma/transformers/2b` (KAGGLE_USERNAME / KAGGLE_KEY)."""
    import kagglehub

    try:
        folder = Path(kagglehub.model_download(handle))
    except Exception as err:
        raise ModelError(
            f"could not download Kaggle model '{handle}': {err}. Set KAGGLE_USERNAME and KAGGLE_KEY "
            "(or `kaggle:` credentials in conf/local/credentials.yml) and accept the model's licence on Kaggle."
        ) from err
    check_folder(folder)
    return folder


def check_folder(folder: Path) -> None:
    missing = [n for n in ("config.json",) if not (folder / n).is_file()]
    if not list(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelError(f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)}")


def read_hf_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


@contextlib.contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """A temporary folder beside `out`, moved into its place only if the block succeeds:
    a failure never leaves a half-written model."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
