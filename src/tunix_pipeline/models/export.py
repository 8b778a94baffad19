"""Tunix models -> Hugging Face folders that `transformers` (and vLLM) load."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from safetensors.numpy import save_file
from transformers import GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tunix_pipeline.core.paths import atomic_folder
from tunix_pipeline.core.processes import on_main_process
from tunix_pipeline.models.families import family_for
from tunix_pipeline.models.gguf_export import write_gguf
from tunix_pipeline.models.loading import origin_of
from tunix_pipeline.models.lora import merge_lora

MAX_SHARD_SIZE = "2GB"


def export_pretrained(
    model,
    out_dir: str | Path,
    tokenizer=None,
    *,
    hf_config: dict | None = None,
    lora_alpha: float | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    gguf_dir: str | Path | None = None,
    gguf_types: tuple[str, ...] | list[str] = ("f16", "q8_0"),
    chat_template: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Writes config.json, safetensors shards (with an index when more than one), generation config and tokenizer.

    LoRA adapters are merged into the weights (`lora_alpha` is needed then). The
    folder is written next to `out_dir` and moved into place at the end, so a
    failure never leaves a half-written model. Multi-host: every process calls it
    (the weights are gathered from all of them) and process 0 alone writes.
    With `gguf_dir`, GGUF files of `gguf_types` and an Ollama Modelfile are written there
    first (`chat_template`: the one the model was tuned with; default the tokenizer's). `dtype`: the folder's
    weights cast to it (float32 masters shipped in bf16); default as trained. GGUF is written from the weights
    as trained.
    """
    if hf_config is None:
        family, hf_config = origin_of(model)
    else:
        family = family_for(hf_config)
    params = merge_lora(model, lora_alpha)
    state = family.to_hf_state(params, family.config_from_hf(hf_config), hf_config)

    def write():
        if gguf_dir is not None:
            write_gguf(state, hf_config, tokenizer, gguf_dir, gguf_types, chat_template=chat_template)
        shipped = state if dtype is None else {k: np.asarray(v).astype(jnp.dtype(dtype)) for k, v in state.items()}
        _write(shipped, out_dir, tokenizer, hf_config, max_shard_size)

    on_main_process("export", write)
    return Path(out_dir)


def _write(state: dict, out_dir, tokenizer, hf_config: dict, max_shard_size) -> None:
    dtype = str(next(iter(state.values())).dtype)
    with atomic_folder(out_dir) as tmp:
        split = split_state_dict_into_shards_factory(
            state,
            get_storage_size=lambda t: t.nbytes,
            filename_pattern="model{suffix}.safetensors",
            max_shard_size=max_shard_size,
        )
        for filename, names in split.filename_to_tensors.items():
            save_file({n: np.ascontiguousarray(state[n]) for n in names}, str(tmp / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {**split.metadata, "total_size": int(sum(t.nbytes for t in state.values()))},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = {k: v for k, v in hf_config.items() if k not in ("torch_dtype", "dtype")}
        config["dtype"] = dtype
        if not config.get("architectures"):  # a built or GGUF-converted config has none; MLflow and vLLM read it
            config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        GenerationConfig(
            **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        ).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
