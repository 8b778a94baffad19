"""GGUF files (llama.cpp's format) as Hugging Face folders, read with the `gguf` package (numpy, no torch).

`model.source` may name a .gguf file, or a folder holding one. `gguf_to_folder` writes what a
downloaded checkpoint has: config.json from the file's metadata, model.safetensors with every
tensor dequantized to float32 under transformers' name and layout, and the tokenizer (with the
file's chat template) built from the vocabulary in the metadata. The families then load it like
any other folder, and the stages after it (tokenizer, training, export) need nothing new.

llama.cpp's converter changes some tensors on the way in; they are undone here: Llama's q/k rows
are permuted back, and Gemma's RMSNorm weights, stored as 1 + w, lose their 1 again.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import AutoConfig, PreTrainedTokenizerFast

from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.core.paths import atomic_folder
from tunix_pipeline.models.families.llama import rope_frequencies

# general.architecture -> transformers' model_type, for the architectures we have a family for
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}
GEMMAS = ("gemma", "gemma2", "gemma3")
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {  # blk.N.<llama.cpp name> -> model.layers.N.<transformers name>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",  # the pre-MLP norm in Llama, Qwen and Gemma 1
}
SANDWICH_NORMS = {  # Gemma 2 and 3 norm both sides of attention and MLP
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
# tokenizer.ggml.pre -> the split regex of the Hugging Face tokenizer it stands for (Llama 3 keeps up to
# three digits together, Qwen one)
PRE_TOKENIZERS = {
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
STAMP = "gguf_source.json"


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only .gguf in a folder without config.json."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path} is not a .gguf file: point model.source at a .gguf file or a model folder")
        return path
    if (path / "config.json").is_file():
        return None
    # llama.cpp ships vision projectors (mmproj-*.gguf) beside the language model
    files = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelError(f"{path} holds {len(files)} GGUF files ({names}): point model.source at one of them")
    return files[0] if files else None


def gguf_to_folder(path: str | Path, out_dir: str | Path) -> Path:
    """A Hugging Face folder at `out_dir` with the GGUF file's weights and tokenizer, kept while the file is the same."""
    path, out = Path(path).resolve(), Path(out_dir)
    if path.is_relative_to(out.resolve()):
        raise ModelError(f"model.local_dir ({out}) holds the GGUF file {path}; it is replaced by the converted model")
    digest = sha256_file(path)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("sha256") == digest:
        return out
    reader, meta = read_gguf(path)
    config = hf_config(meta, reader.tensors, path)
    tokenizer = build_tokenizer(meta, path)
    tensors = hf_tensors(reader.tensors, meta, config, path)
    with atomic_folder(out) as tmp:
        AutoConfig.for_model(**config).save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps({"gguf": str(path), "sha256": digest}, indent=2))
    return out


def read_gguf(path: Path):
    """The file's reader (tensors are memory-mapped, not read) and its metadata."""
    try:
        reader = GGUFReader(path)
    except Exception as err:  # truncated or not a GGUF file
        raise ModelError(f"{path} is not a readable GGUF file: {err}") from err
    return reader, {key: field.contents() for key, field in reader.fields.items()}


def gguf_hf_config(path: Path) -> dict:
    """The config.json the converted folder will have, from the metadata alone (for the plan: no weights read)."""
    reader, meta = read_gguf(path)
    return hf_config(meta, reader.tensors, path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- config


def _rope(arch: str, get, need, tensors, head_dim: int, path: Path) -> dict:
    """transformers' rope parameters: default, linear scaling, or Llama 3's from its `rope_freqs` tensor."""
    theta = float(get("rope.freq_base", 10000.0))
    kind = get("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ModelError(f"{path}: {arch}.rope.scaling.type={kind!r} is not supported (none or linear)")
    freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return _llama3_rope(freqs, theta, head_dim, path)
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(need("rope.scaling.factor")), "rope_theta": theta}
    return {"rope_type": "default", "rope_theta": theta}


def hf_config(meta: dict, tensors, path: Path) -> dict:
    """transformers' config.json for the file, with what llama.cpp assumes where the metadata is silent."""
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPES:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise ModelError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {supported}")
    if meta.get("split.count", 1) > 1:
        count = meta["split.count"]
        raise ModelError(f"{path} is one of {count} split GGUF files: merge them with `llama-gguf-split --merge`")

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ModelError(f"{path}: the GGUF metadata has no {arch}.{key}")
        return meta[f"{arch}.{key}"]

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads, hidden, layers = need("attention.head_count"), need("embedding_length"), need("block_count")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ModelError(f"{path}: per-layer head counts are not supported")
    head_dim = get("attention.key_length") or hidden // heads
    if get("attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{path}: value heads of {get('attention.value_length')} differ from key heads of {head_dim}")
    if get("attention.causal", True) is False:
        raise ModelError(f"{path}: a bidirectional (embedding) model, not a causal LM")
    names = {t.name for t in tensors}
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelError(f"{path} has no token_embd.weight tensor")
    hf = dict(
        model_type=MODEL_TYPES[arch],
        vocab_size=int(embed.shape[-1]),  # GGUF lists dimensions innermost first
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=get("context_length", 8192),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        hf["partial_rotary_factor"] = rope_dims / head_dim  # the families refuse it by name
    rope = _rope(arch, get, need, tensors, head_dim, path)
    if arch in ("llama", "qwen3"):  # (Qwen 2 always has q/k/v biases)
        hf["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch in GEMMAS:
        hf.update(_gemma_settings(arch, get, hf, rope))
    else:
        hf["rope_parameters"] = rope
    return {k: v for k, v in hf.items() if v is not None}


def _gemma_settings(arch: str, get, hf: dict, rope: dict) -> dict:
    """llama.cpp's Gemma: local layers on a fixed pattern with rope base 10000, queries scaled by
    (hidden_size / heads) ** -0.5 in the 27B models (46 layers in Gemma 2, 62 in Gemma 3), else by
    head_dim ** -0.5 (GGUF has no query_pre_attn_scalar)."""
    if arch == "gemma":
        return {"rope_parameters": rope}
    layers, window = hf["num_hidden_layers"], get("attention.sliding_window") or None
    big = layers == {"gemma2": 46, "gemma3": 62}[arch]
    settings = {"query_pre_attn_scalar": hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]}
    pattern = 2 if arch == "gemma2" else 6  # every 2nd / 6th layer global
    settings["layer_types"] = [
        "sliding_attention" if window and (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    settings["sliding_window"] = window or 4096
    if arch == "gemma2":
        settings["rope_parameters"] = rope
        settings["attn_logit_softcapping"] = get("attn_logit_softcapping", 50.0)
        settings["final_logit_softcapping"] = get("final_logit_softcapping", 30.0)
    else:
        local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
        settings["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        settings["final_logit_softcapping"] = get("final_logit_softcapping")
    return settings


def _llama3_rope(tensor, theta: float, head_dim: int, path: Path) -> dict:
    """llama.cpp stores Llama 3.1+'s rope scaling as per-frequency divisors (rope_freqs.weight), not
    as settings: recognise Meta's llama3 scaling (low 1, high 4, original context 8192) with its factor."""
    divisors = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)
    base = np.asarray(rope_frequencies(head_dim, theta), np.float64)
    rope = {
        "rope_type": "llama3", "rope_theta": theta, "factor": float(divisors.max()),
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    scaled = rope_frequencies(head_dim, theta, tuple((k, v) for k, v in rope.items() if k != "rope_theta"))
    if divisors.shape != base.shape or not np.allclose(base / divisors, scaled, rtol=1e-5, atol=0):
        raise ModelError(f"{path}: rope_freqs.weight is not Llama 3's rope scaling (low 1, high 4, context 8192)")
    return rope


# ---------------------------------------------------------------------------- tensors


def hf_tensors(tensors, meta: dict, hf: dict, path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, named and laid out as in transformers' checkpoints."""
    arch = meta["general.architecture"]
    layer_names = {**LAYER_TENSORS, **(SANDWICH_NORMS if arch in ("gemma2", "gemma3") else {})}
    out, unknown = {}, []
    for t in tensors:
        name = _hf_name(t.name, layer_names)
        if name is None:
            if t.name != "rope_freqs.weight":  # read into the config
                unknown.append(t.name)
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ModelError(
                f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which the gguf package cannot "
                f"dequantize ({err}); use a file quantized as F32, F16, BF16, Q8_0, Q4_K_M or another k-quant"
            ) from err
        w = np.asarray(w, np.float32).reshape([int(n) for n in reversed(t.shape)])
        if arch == "llama" and re.search(r"\.self_attn\.[qk]_proj\.", name):
            w = _unpermute(w, hf["num_attention_heads"] if ".q_proj." in name else hf["num_key_value_heads"])
        if arch in GEMMAS and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        out[name] = w
    if unknown:
        raise ModelError(f"{path}: tensors with no place in a {arch} model: {', '.join(unknown[:8])}")
    return out


def _hf_name(name: str, layer_names: dict) -> str | None:
    match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", name)
    if match is None:
        return None
    layer, base, kind = match.groups()
    if layer is None:
        return f"{GLOBAL_TENSORS[base]}.{kind}" if base in GLOBAL_TENSORS else None
    return f"model.layers.{layer}.{layer_names[base]}.{kind}" if base in layer_names else None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it interleaves each head's two rotary halves, transformers keeps them apart."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- tokenizer


def build_tokenizer(meta: dict, path: Path):
    """A fast tokenizer from the vocabulary, merges, special tokens and chat template in the metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{path} has no vocabulary (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "llama":
        backend = _sentencepiece_bpe(tokens, types, meta)
    elif kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta, path)
    else:
        supported = "llama (SentencePiece) or gpt2 (byte-level BPE)"
        raise ModelError(f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: {supported}")
    # control tokens are special (matched in text, skipped when decoding); user-defined ones are plain pieces
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    user_defined = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    # llama.cpp adds BOS by default for SentencePiece vocabularies only
    first = [token("bos")] if token("bos") and meta.get("tokenizer.ggml.add_bos_token", kind == "llama") else []
    last = [token("eos")] if token("eos") and meta.get("tokenizer.ggml.add_eos_token", False) else []
    if first or last:
        backend.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *last],
            pair=[*first, "$A", *last, *first, "$B", *last],
            special_tokens=[(t, backend.token_to_id(t)) for t in {*first, *last}],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _sentencepiece_bpe(tokens: list[str], types: list[int], meta: dict):
    """SentencePiece BPE (Gemma, Llama 2) as a `tokenizers` BPE. SentencePiece joins the adjacent pair whose
    joined piece scores highest, so each split of a normal piece is a merge, ranked by that piece's score."""
    scores = meta["tokenizer.ggml.scores"]
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    ranked = sorted((i for i, ty in enumerate(types) if ty == NORMAL), key=lambda i: (-scores[i], i))
    merges = [
        (piece[:k], piece[k:])
        for piece in (tokens[i] for i in ranked)
        for k in range(1, len(piece))
        if piece[:k] in normal and piece[k:] in normal
    ]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(
        models.BPE(
            {t: i for i, t in enumerate(tokens)}, merges,
            unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return backend


def _byte_level_bpe(tokens: list[str], meta: dict, path: Path):
    """GPT-2-style byte-level BPE (Llama 3, Qwen), split first by the regex `tokenizer.ggml.pre` names."""
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ModelError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()  # as Qwen's own tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend
