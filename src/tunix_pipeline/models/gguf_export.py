"""Tuned models out as GGUF files (llama.cpp, Ollama, LM Studio), written with the `gguf` package.

From the Hugging Face state the export already computes, one file per type (F32, F16, BF16, Q8_0)
is written as llama.cpp's `convert_hf_to_gguf.py` writes it: its tensor names (`gguf.TensorNameMap`),
Llama's q/k rows permuted to its rotary layout, Gemma's norm weights stored as 1 + w, norms and
other 1-D tensors in F32, and the tokenizer (vocabulary, merges or scores, token types, special
tokens, chat template) in the metadata. Beside the files, an Ollama `Modelfile` whose TEMPLATE is
the chat template as a Go template, with its stop strings.

The metadata is first read as the GGUF reader (`models/gguf.py`, which knows what llama.cpp assumes where
the metadata is silent) reads it: a model that llama.cpp would run differently (a Gemma 3 with another
sliding-window pattern, a Gemma 2 without attention softcapping, ...) is refused before any file is written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
from transformers import AutoConfig

from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.core.paths import atomic_folder
from tunix_pipeline.models.families import family_for
from tunix_pipeline.models.families.llama import rope_frequencies, rope_scaling_from_hf
from tunix_pipeline.models.gguf import GEMMAS, MODEL_TYPES
from tunix_pipeline.models.gguf import hf_config as gguf_hf_config
from tunix_pipeline.models.gguf_vocab import add_vocab, gguf_vocab
from tunix_pipeline.models.ollama import modelfile

ARCHITECTURES = {model_type: arch for arch, model_type in MODEL_TYPES.items()}  # model_type -> llama.cpp arch
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
MODELFILE = "Modelfile"

# formatting.gemma_turns as a chat template: what a model tuned without a template of its own was trained on
GEMMA_TURNS_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if loop.first and m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (ns.system + m['content']) | trim }}<end_of_turn>\n{% set ns.system = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tuned_chat_template(tokenizer, mode: str) -> str:
    """The chat template the model was tuned with, as `formatting.render_prompt` chose it: the tokenizer's own
    with format.chat_template: auto, else Gemma's turns."""
    if mode == "auto" and getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    return GEMMA_TURNS_TEMPLATE


def write_gguf(
    state: dict[str, np.ndarray],
    hf_config: dict,
    tokenizer,
    out_dir: str | Path,
    types: tuple[str, ...] | list[str] = ("f16", "q8_0"),
    *,
    chat_template: str | None = None,
    name: str = "model",
) -> list[Path]:
    """`out_dir` with `<name>-<type>.gguf` for each type and a Modelfile (FROM the first one).

    `state` is the model in transformers' names and layout (`Family.to_hf_state`), `tokenizer` the
    fast tokenizer shipped with it, `chat_template` the template it was tuned with (default: the
    tokenizer's). Written to a temporary folder and moved into place: never half-written.
    """
    arch = ARCHITECTURES.get(hf_config.get("model_type"))
    if arch is None:
        raise ModelError(
            f"GGUF export: model_type {hf_config.get('model_type')!r} has no llama.cpp architecture here "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}); set export.formats: [hf]"
        )
    if tokenizer is None:
        raise ModelError("GGUF export: the model has no tokenizer, and a GGUF file must carry one; set export.formats: [hf]")
    unknown = [t for t in types if t not in GGUF_TYPES]
    if unknown or not types:
        raise ModelError(f"GGUF export: types {list(types)} must be one or more of {', '.join(GGUF_TYPES)}")
    config = _hf_config_object(hf_config)
    rows = state["model.embed_tokens.weight"].shape[0]
    vocab = gguf_vocab(tokenizer, rows)
    check_llama_cpp_reads_the_same_model(state, hf_config, config, arch)
    template = chat_template if chat_template is not None else tokenizer.chat_template
    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        files = []
        for kind in dict.fromkeys(types):
            path = tmp / f"{name}-{kind}.gguf"
            writer = gguf.GGUFWriter(path, arch, use_temp_file=True)  # tensors go to disk as they come, not to memory
            writer.add_name(name)
            _add_hyperparameters(writer, config, arch, rows)
            add_vocab(writer, vocab, tokenizer, template)
            _add_tensors(writer, gguf_tensors(state, config, arch), kind)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            files.append(out / path.name)
        (tmp / MODELFILE).write_text(modelfile(files[0].name, tokenizer, template, vocab.add_bos))
    return files


def _hf_config_object(hf_config: dict):
    """transformers' config for the dict, so that every default is filled in as transformers fills it."""
    fields = {k: v for k, v in hf_config.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    return AutoConfig.for_model(**fields)


# ---------------------------------------------------------------------------- hyperparameters


def _add_hyperparameters(w, c, arch: str, rows: int) -> None:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads or c.num_attention_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(rows)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch in ("gemma2", "gemma3") and "sliding_attention" in (c.layer_types or []):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2" and c.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch in ("gemma2", "gemma3") and c.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3" and c.rope_parameters["sliding_attention"]["rope_theta"] != 10000.0:
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])


# ---------------------------------------------------------------------------- tensors


def tensor_names(state: dict[str, np.ndarray], c, arch: str) -> dict[str, str]:
    """{HF name: llama.cpp's name} (`gguf.TensorNameMap`), refusing a tensor llama.cpp has no place for."""
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    out = {}
    for hf_name in state:
        base, kind = hf_name.rsplit(".", 1)
        if (name := names.get_name(base)) is None:
            raise ModelError(f"GGUF export: tensor {hf_name} has no place in llama.cpp's {arch} architecture")
        out[hf_name] = f"{name}.{kind}"
    return out


def gguf_tensors(state: dict[str, np.ndarray], c, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors as float32 under llama.cpp's names and in its layout, one at a time."""
    for hf_name, name in tensor_names(state, c, arch).items():
        base = hf_name.rsplit(".", 1)[0]
        w = np.asarray(state[hf_name], np.float32)
        if arch == "llama" and base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = c.num_attention_heads if base.endswith("q_proj") else c.num_key_value_heads
            w = permute_qk(w, heads)
        if arch in GEMMAS and hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # transformers' Gemma scales by 1 + w, llama.cpp's by w
        yield name, w
    if arch == "llama" and c.rope_parameters.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_rope_divisors(c)


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama: each head's two rotary halves interleaved (transformers
    keeps them apart); the inverse of `models.gguf._unpermute`."""
    return w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_divisors(c) -> np.ndarray:
    """Llama 3.1's rope scaling as llama.cpp keeps it: one divisor per frequency (rope_freqs.weight)."""
    theta, scaling = rope_scaling_from_hf("llama", c.to_dict())
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (rope_frequencies(head_dim, theta) / rope_frequencies(head_dim, theta, scaling)).astype(np.float32)


def _add_tensors(w, tensors: Iterator[tuple[str, np.ndarray]], kind: str) -> None:
    """Matrices in `kind`; vectors and norms in F32, as llama.cpp's converter stores them."""
    Q = gguf.GGMLQuantizationType
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[kind]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    w.add_file_type(file_type)
    if qtype == Q.Q8_0:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, tensor in tensors:
        t = qtype if tensor.ndim == 2 and not name.endswith("_norm.weight") else Q.F32
        if t == Q.Q8_0 and tensor.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
            t = Q.F16  # rows that are no whole number of blocks: llama.cpp's converter falls back to F16 too
        data = gguf.quants.quantize(tensor, t)
        w.add_tensor(name, data, raw_dtype=t if t not in (Q.F32, Q.F16) else None)


# ---------------------------------------------------------------------------- checks


def check_llama_cpp_reads_the_same_model(state: dict[str, np.ndarray], hf_config: dict, config, arch: str) -> None:
    """The metadata and tensors as the GGUF reader (`models.gguf`, which fills in what llama.cpp assumes where the
    metadata is silent) reads them give the same model: refuse one llama.cpp would run differently."""
    probe = gguf.GGUFWriter(None, arch)  # no file: the metadata as the files will hold it
    _add_hyperparameters(probe, config, arch, state["model.embed_tokens.weight"].shape[0])
    meta = {key: value.value for key, value in probe.kv_data[0].items()}
    # tensors as the reader lists them: GGUF dimension order (innermost first)
    tensors = [SimpleNamespace(name=name, shape=state[hf_name].shape[::-1])
               for hf_name, name in tensor_names(state, config, arch).items()]
    if arch == "llama" and config.rope_parameters.get("rope_type") == "llama3":
        divisors = _llama3_rope_divisors(config)
        tensors.append(SimpleNamespace(name="rope_freqs.weight", shape=divisors.shape, data=divisors,
                                       tensor_type=gguf.GGMLQuantizationType.F32))
    family = family_for(hf_config)
    read = gguf_hf_config(meta, tensors, Path("the GGUF metadata"))
    ours, theirs = family.config_from_hf(hf_config), family.config_from_hf(read)
    differ = [
        f"{f.name}: the model has {getattr(ours, f.name)!r}, llama.cpp would use {getattr(theirs, f.name)!r}"
        for f in dataclasses.fields(ours)
        if not _same(getattr(ours, f.name), getattr(theirs, f.name))
    ]
    if differ:
        raise ModelError(f"GGUF export: llama.cpp cannot run this {family.name} model as it is ({'; '.join(differ)}); "
                         "set export.formats: [hf]")


def _same(a, b) -> bool:
    """Equal, floats to float32 precision (GGUF stores them as float32)."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
