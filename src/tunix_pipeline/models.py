"""Base models as Hugging Face folders, loaded into Tunix's Flax NNX models.

A model is always a folder (config.json, *.safetensors, tokenizer files):
downloaded from the hub for real runs, or built here for offline runs (a tiny
Gemma with random weights and a tokenizer trained on the project's data).
The same loader reads both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tunix_pipeline.config import ModelParams, TinyModelParams

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model"]


class ModelError(ValueError):
    """A model folder or id that cannot be used; the message says how to fix it."""


# ---------------------------------------------------------------- locating the folder
def resolve_model_dir(params: ModelParams, corpus: Iterable[str] = ()) -> Path:
    """The folder holding the base model: built (tiny), local, or downloaded."""
    if params.source == "tiny":
        return build_tiny_gemma(params.local_dir, corpus, params.tiny)
    local = Path(params.source)
    if local.exists():
        _check_folder(local)
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
    _check_folder(folder)
    return folder


def _check_folder(folder: Path) -> None:
    missing = [n for n in ("config.json",) if not (folder / n).is_file()]
    if not list(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelError(f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)}")


# ---------------------------------------------------------------- the tiny model
def build_tiny_gemma(out_dir: str | Path, corpus: Iterable[str], spec: TinyModelParams) -> Path:
    """A Gemma-architecture HF folder with random weights and a BPE tokenizer trained on `corpus`.

    Deterministic for the same corpus and spec; written to a temporary folder
    and moved into place, so a failure never leaves a half-written model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GemmaConfig, PreTrainedTokenizerFast
    from safetensors.numpy import save_file

    texts = list(corpus)
    if not texts:
        raise ModelError("cannot train the tiny model's tokenizer on an empty corpus")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    # Round the embedding up (like Gemma's 256128 rows for 256000 tokens) so it
    # shards evenly over the tensor-parallel axis.
    vocab = -(-len(tokenizer) // 64) * 64
    config = GemmaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=8192,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    weights = _random_gemma_weights(config, spec.seed)

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _random_gemma_weights(config, seed: int) -> dict[str, np.ndarray]:
    """Transformers' Gemma layout and init: normal(0, initializer_range), norms 0 (Gemma scales by 1 + w)."""
    rng = np.random.default_rng(seed)
    std = config.initializer_range
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def normal(*shape):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, d), "model.norm.weight": np.zeros(d, np.float32)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": normal(q, d),
                p + "self_attn.k_proj.weight": normal(kv, d),
                p + "self_attn.v_proj.weight": normal(kv, d),
                p + "self_attn.o_proj.weight": normal(d, q),
                p + "mlp.gate_proj.weight": normal(f, d),
                p + "mlp.up_proj.weight": normal(f, d),
                p + "mlp.down_proj.weight": normal(d, f),
                p + "input_layernorm.weight": np.zeros(d, np.float32),
                p + "post_attention_layernorm.weight": np.zeros(d, np.float32),
            }
        )
    return weights


# ---------------------------------------------------------------- loading
def read_hf_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def gemma_config(hf: dict):
    """Tunix's Gemma (1) config from a transformers `config.json`.

    Tunix's Gemma hard-codes rope theta 10000, RMSNorm eps 1e-6 and query
    scaling by head_dim**-0.5: refuse checkpoints that differ rather than
    train a silently different model.
    """
    from tunix.models.gemma import model as gemma_lib

    if hf.get("model_type") != "gemma":
        raise ModelError(
            f"model_type '{hf.get('model_type')}' is not supported yet; this loader reads Gemma (1) "
            "checkpoints such as google/gemma-2b"
        )
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    eps = hf.get("rms_norm_eps", 1e-6)
    if float(theta) != 10000.0 or abs(float(eps) - 1e-6) > 1e-12:
        raise ModelError(f"Gemma with rope_theta={theta}, rms_norm_eps={eps} differs from Tunix's fixed 10000 / 1e-6")
    layers = hf["num_hidden_layers"]
    return gemma_lib.ModelConfig(
        num_layers=layers,
        num_embed=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        final_logit_softcap=None,
        use_post_attn_norm=False,
        use_post_ffw_norm=False,
        attention_types=(gemma_lib.AttentionType.GLOBAL,) * layers,
    )


def _gemma1_key_mapping(cfg):
    """Tunix's Gemma mapping with Gemma 1's norm fixed (see docs/upstream_tunix.md).

    In Gemma 1, `post_attention_layernorm` is the norm *before* the MLP; Tunix
    maps it to the post-attention norm, which Gemma 1 does not have.
    """
    from tunix.models.gemma import params_safetensors

    mapping = params_safetensors._get_key_and_transform_mapping(cfg)
    mapping[r"model\.layers\.([0-9]+)\.post_attention_layernorm\.weight"] = (
        r"layers.\1.pre_ffw_norm.scale",
        None,
    )
    return mapping


def load_model(folder: str | Path, mesh: jax.sharding.Mesh | None, dtype: str = "float32"):
    """(Tunix Gemma model sharded over `mesh`, its Tunix config)."""
    from tunix.models import safetensors_loader
    from tunix.models.gemma import model as gemma_lib
    from tunix.models.gemma import params_safetensors

    folder = Path(folder)
    _check_folder(folder)
    cfg = gemma_config(read_hf_config(folder))
    if mesh is not None:
        _check_divisible(cfg, mesh)
    model = safetensors_loader.load_and_create_model(
        file_dir=str(folder),
        model_class=gemma_lib.Gemma,
        config=cfg,
        key_mapping=_gemma1_key_mapping,
        mesh=mesh,
        preprocess_fn=params_safetensors._make_preprocess_fn(cfg),
        dtype=jnp.dtype(dtype),
        # the "optimized" reader fails on files that mix dtypes
        mode="original",
    )
    return model, cfg


def _check_divisible(cfg, mesh) -> None:
    tp, fsdp = mesh.shape.get("tp", 1), mesh.shape.get("fsdp", 1)
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads={cfg.num_heads} is not divisible by tp={tp}")
    if cfg.num_embed % tp:
        problems.append(f"vocab size {cfg.num_embed} is not divisible by tp={tp}")
    if cfg.embed_dim % fsdp:
        problems.append(f"hidden size {cfg.embed_dim} is not divisible by fsdp={fsdp}")
    if problems:
        raise ModelError(f"the model does not shard over mesh {dict(mesh.shape)}: {'; '.join(problems)}")


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def model_summary(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, (int, float, str, bool))}
