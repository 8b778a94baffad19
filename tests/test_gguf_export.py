"""GGUF out: tuned models of every family with a llama.cpp architecture, written as GGUF files and read back by
transformers (its own GGUF reader, which we did not write): the same tokens as the exported Hugging Face
tokenizer, F16 logits within 1e-2 of the Hugging Face export, and Q8_0's greedy tokens equal to its.

Where transformers' reader stands in for llama.cpp only roughly (it has no Gemma 1, reads SentencePiece
vocabularies as unigram models and splits every Llama vocabulary with GPT-2's regex), the files are read back
with models.gguf, which follows llama.cpp there."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers
from pydantic import ValidationError
from safetensors.numpy import load_file

from tunix_pipeline.config import ExportParams
from tunix_pipeline.data.formatting import gemma_turns
from tunix_pipeline.models import ModelError, export_pretrained, load_model
from tunix_pipeline.models.gguf import build_tokenizer, gguf_to_folder
from tunix_pipeline.models.gguf_export import GEMMA_TURNS_TEMPLATE, MODELFILE

from .parity import sample_batch, save_hf_model
from .test_gguf import RAW, SAMPLES, SPECIAL, USER_DEFINED, byte_level_tokenizer, corpus, llama3_tokenizer

CHATS = [json.loads(line)["messages"] for line in (RAW / "arith_chat.jsonl").read_text().splitlines()[:20]]
# transformers reads a SentencePiece vocabulary (Gemma's) as a unigram model: the fewest pieces, where BPE (the HF
# tokenizer, llama.cpp) may take more. Exact on the project's text, it differs on some words BPE never merged whole
# ("don't": "▁do n" for "▁ d on") and on runs of three spaces ("▁ ▁▁" for "▁▁ ▁"): models.gguf reads those.
UNIGRAM_MISREADS = SAMPLES[1:3]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMALL = dict(hidden_size=64, intermediate_size=128, initializer_range=0.1)


def gemma_tokenizer(folder):
    """A SentencePiece BPE with Gemma's settings and special tokens, as transformers' GemmaTokenizer reads it."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_prefix=str(folder / "tokenizer"), model_type="bpe", vocab_size=400,
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", control_symbols=["<start_of_turn>", "<end_of_turn>"],
        user_defined_symbols=USER_DEFINED, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2,
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer", "add_bos_token": True}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = GEMMA_TURNS_TEMPLATE
    return tokenizer


def tiny_tokenizer(folder, tiny_model_dir):
    """The project's own tiny-model tokenizer (byte-level BPE, GPT-2's split), with Gemma's turns as template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = GEMMA_TURNS_TEMPLATE
    return tokenizer


def qwen_tokenizer(folder):
    """transformers' Qwen2 tokenizer over a vocabulary trained here, with Qwen's special tokens and ChatML."""
    trained = json.loads(byte_level_tokenizer(r"\S+|\s+").to_str())["model"]
    vocab = {t: i for t, i in trained["vocab"].items() if t not in SPECIAL}
    tokenizer = transformers.Qwen2Tokenizer(
        vocab=vocab, merges=[tuple(m) for m in trained["merges"]],
        unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def _rows(tokenizer) -> int:
    return -(-len(tokenizer) // 32) * 32 + 32  # rows beyond the vocabulary, as hub checkpoints have


# family -> (tokenizer maker, config maker). transformers reads less from a GGUF file than the file holds; where its
# defaults stand in (Gemma 2's softcaps and query scaling 256, Qwen 3's head_dim 128) the configs use them.
FAMILIES = {
    "gemma": (gemma_tokenizer, lambda v: transformers.GemmaConfig(
        vocab_size=v, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16, **SMALL)),
    "gemma2": (gemma_tokenizer, lambda v: transformers.Gemma2Config(
        vocab_size=v, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        sliding_window=4, **SMALL)),
    "gemma3": (gemma_tokenizer, lambda v: transformers.Gemma3TextConfig(
        vocab_size=v, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=4, **SMALL)),
    "llama": (tiny_tokenizer, lambda v: transformers.LlamaConfig(
        vocab_size=v, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, **SMALL)),
    "llama3": (llama3_tokenizer, lambda v: transformers.LlamaConfig(  # Llama 3's split regex: read by models.gguf
        vocab_size=v, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **SMALL,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": (qwen_tokenizer, lambda v: transformers.Qwen2Config(
        vocab_size=v, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        **SMALL)),
    "qwen3": (qwen_tokenizer, lambda v: transformers.Qwen3Config(
        vocab_size=v, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        tie_word_embeddings=False, **SMALL)),
}
READ_BY_TRANSFORMERS = ["gemma2", "gemma3", "llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    """family -> (HF export folder, GGUF folder), each made once from a tiny random model through our model."""
    cache = {}

    def export(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            make_tokenizer, make_config = FAMILIES[family]
            args = (root, tiny_model_dir) if make_tokenizer is tiny_tokenizer else (root,)
            tokenizer = make_tokenizer(*args)
            save_hf_model(make_config(_rows(tokenizer)), root)
            model, _ = load_model(root, None)
            export_pretrained(model, root / "hf", tokenizer, gguf_dir=root / "gguf", gguf_types=["f16", "q8_0"])
            cache[family] = root / "hf", root / "gguf"
        return cache[family]

    return export


def _texts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template(chat, tokenize=False) for chat in CHATS] + SAMPLES


def _logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize("family", READ_BY_TRANSFORMERS)
def test_transformers_reads_the_tokenizer_back(exported, family):
    hf, folder = exported(family)
    ours = transformers.AutoTokenizer.from_pretrained(hf)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="model-f16.gguf")
    unigram = isinstance(theirs, transformers.GemmaTokenizer)
    for text in _texts(ours):
        if not (unigram and text in UNIGRAM_MISREADS):
            assert theirs(text, add_special_tokens=False).input_ids == ours(text, add_special_tokens=False).input_ids, text
    # transformers' GGUF tokenizers do not read these; llama.cpp does
    meta = gguf.GGUFReader(folder / "model-f16.gguf").fields
    assert meta["tokenizer.ggml.add_bos_token"].contents() == (ours("a").input_ids[0] == ours.bos_token_id)
    assert meta["tokenizer.chat_template"].contents() == ours.chat_template


def _q8_0_rounded(model):
    """The model with every matrix rounded as Q8_0 rounds it (vectors stay float32, as in the GGUF file)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                q = gguf.quants.quantize(param.numpy(), gguf.GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    return model


@pytest.mark.parametrize("family", READ_BY_TRANSFORMERS)
def test_transformers_reads_f16_logits_and_q8_0_greedy_tokens_back(exported, family):
    hf, folder = exported(family)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    f16 = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model-f16.gguf", dtype=torch.float32)
    q8 = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model-q8_0.gguf", dtype=torch.float32)
    # F16 keeps 11 significant bits of each weight (relative error up to 2**-11): logits of size 1.6 to 4 here move
    # by about 1e-3 of their size (0.8e-3 to 4.3e-3 measured), inside the 1e-2 asked for
    tokens, mask = sample_batch(reference.config.vocab_size)
    real = mask.astype(bool)
    np.testing.assert_allclose(_logits(f16, tokens, mask)[real], _logits(reference, tokens, mask)[real], atol=1e-2, rtol=0)

    # Greedy next tokens at every position of the test prompts. A random model has near-ties there that any
    # rounding flips; Q8_0 cannot flip a choice that leads by more than twice what Q8_0's rounding of the exported
    # weights (done here, not read from the file) moves a logit: those must be the same.
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    rounded = _q8_0_rounded(transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32))
    checked = 0
    for chat in CHATS[:8]:
        ids = np.asarray([tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]])
        ones = np.ones_like(ids)
        expected, moved = _logits(reference, ids, ones)[0], _logits(rounded, ids, ones)[0]
        top2 = np.sort(expected, axis=-1)[:, -2:]
        decisive = top2[:, 1] - top2[:, 0] > 2 * np.abs(moved - expected).max(-1) + 1e-4
        got = _logits(q8, ids, ones)[0].argmax(-1)
        np.testing.assert_array_equal(got[decisive], expected.argmax(-1)[decisive], err_msg=str(chat))
        checked += decisive.sum()
    assert checked >= 200, f"only {checked} decisive positions"  # 390 to 680 of about 800 here


@pytest.mark.parametrize("family", ["gemma", "gemma3", "llama3"])
def test_models_gguf_reads_back_what_transformers_cannot(exported, family, tmp_path):
    """Gemma 1, SentencePiece's merge order and Llama 3's split regex, read as llama.cpp reads them."""
    hf, folder = exported(family)
    ours = transformers.AutoTokenizer.from_pretrained(hf)
    path = folder / "model-f16.gguf"
    reader = gguf.GGUFReader(path)
    theirs = build_tokenizer({k: f.contents() for k, f in reader.fields.items()}, path)
    for text in _texts(ours):
        assert theirs(text).input_ids == ours(text).input_ids, text  # BOS as llama.cpp adds it
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    read = transformers.AutoModelForCausalLM.from_pretrained(gguf_to_folder(path, tmp_path / "read"), dtype=torch.float32)
    tokens, mask = sample_batch(reference.config.vocab_size)
    real = mask.astype(bool)
    np.testing.assert_allclose(_logits(read, tokens, mask)[real], _logits(reference, tokens, mask)[real], atol=1e-2, rtol=0)


# ---------------------------------------------------------------------------- Ollama's Modelfile


def ollama_render(template: str, messages: list[dict]) -> str:
    """Go's text/template, as much of it as Ollama's chat templates use (and no more: anything else fails)."""
    parts: list = []
    for piece in re.split(r"({{.*?}})", template, flags=re.S):
        if piece.startswith("{{"):
            if piece.startswith("{{-") and parts and isinstance(parts[-1], str):
                parts[-1] = parts[-1].rstrip()
            parts.append(("action", piece[2:-2].strip("-").strip()))
        elif piece:
            parts.append(piece)

    def cond(expr: str, message, last: bool) -> bool:
        if m := re.fullmatch(r'eq \.Role "(\w+)"', expr):
            return message["role"] == m.group(1)
        if expr in ("$last", "not $last"):
            return last if expr == "$last" else not last
        if expr == 'or (not .Messages) (ne (index .Messages 0).Role "system")':
            return not messages or messages[0]["role"] != "system"
        raise AssertionError(f"unexpected template condition {expr!r}")

    def run(i: int, message, last: bool, out: list) -> tuple[int, str]:
        """Renders from parts[i] to the next else/end at this level; returns (index there, that keyword)."""
        while i < len(parts):
            part = parts[i]
            if isinstance(part, str):
                out.append(part)
                i += 1
                continue
            action = part[1]
            if action == "end" or action.startswith("else"):
                return i, action
            if action.startswith("range $i, $_ := .Messages"):
                body = i + 1
                for n, msg in enumerate(messages):
                    i, _ = run(body, msg, n == len(messages) - 1, out)
                if not messages:
                    i, _ = run(body, None, False, [])
                i += 1
            elif action.startswith("$last :="):
                i += 1
            elif action.startswith("if "):
                taken, expr = False, action[3:]
                while True:
                    branch: list = []
                    i, stop = run(i + 1, message, last, branch)
                    if not taken and (expr is None or cond(expr, message, last)):
                        out += branch
                        taken = True
                    if stop == "end":
                        break
                    expr = stop[len("else if "):] if stop.startswith("else if ") else None
                i += 1
            elif action == ".Content":
                out.append(message["content"])
                i += 1
            elif action.startswith('"'):
                out.append(json.loads(action))
                i += 1
            else:
                raise AssertionError(f"unexpected template action {action!r}")
        return i, ""

    out: list = []
    run(0, None, False, out)
    return "".join(out)


@pytest.mark.parametrize("family", ["gemma3", "qwen2", "llama"])
def test_modelfile_renders_conversations_as_the_chat_template_does(exported, family):
    hf, folder = exported(family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    modelfile = (folder / MODELFILE).read_text()
    assert modelfile.startswith("FROM ./model-f16.gguf\n") and (folder / "model-f16.gguf").is_file()
    template = re.search(r'TEMPLATE """(.*?)"""\n', modelfile, re.S).group(1)
    stops = re.findall(r"^PARAMETER stop (.+)$", modelfile, re.M)
    end_of_turn = {"qwen2": "<|im_end|>"}.get(family, "<end_of_turn>")
    assert json.loads(stops[0]) == end_of_turn and {json.loads(s) for s in stops} <= {end_of_turn, tokenizer.eos_token}

    bos = tokenizer.bos_token if tokenizer("a").input_ids[0] == tokenizer.bos_token_id else None  # llama.cpp adds it
    chat = CHATS[0] + [{"role": "user", "content": "And 2 + 2?"}]
    conversations = [chat[:1], chat[:2], chat]
    if family == "qwen2":  # Gemma's turns fold a system prompt into the first user turn; Ollama's cannot
        conversations.append([{"role": "system", "content": "Answer in the format."}] + chat)
    for messages in conversations:
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=messages[-1]["role"] == "user")
        if messages[-1]["role"] == "assistant":  # Ollama leaves a last assistant turn open, to be continued
            expected = expected[: expected.rindex(messages[-1]["content"]) + len(messages[-1]["content"])]
        assert bos + ollama_render(template, messages) == expected if bos else ollama_render(template, messages) == expected


def test_gemma_turns_template_renders_as_formatting_does(exported):
    """Models tuned without a template of their own ship Gemma's turns, exactly as formatting rendered them."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported("gemma3")[0])
    messages = [{"role": "system", "content": "Be brief. "}, *CHATS[1][:1]]
    rendered = tokenizer.apply_chat_template(messages, chat_template=GEMMA_TURNS_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == gemma_turns(messages, tokenizer.bos_token)


# ---------------------------------------------------------------------------- refusals


def test_a_model_llama_cpp_would_run_differently_is_refused_and_nothing_is_written(tmp_path):
    """llama.cpp's Gemma 3 has a local layer pattern of 5:1; one with another pattern is not shipped as GGUF."""
    tokenizer = gemma_tokenizer(tmp_path)
    config = FAMILIES["gemma3"][1](_rows(tokenizer))
    config.layer_types = ["sliding_attention", "full_attention"] * 3
    model, _ = load_model(save_hf_model(config, tmp_path), None)
    with pytest.raises(ModelError, match=r"llama.cpp cannot run this gemma3_text model as it is \(attention_types: .*"
                                         r"set export.formats: \[hf\]"):
        export_pretrained(model, tmp_path / "hf", tokenizer, gguf_dir=tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists() and not (tmp_path / "hf").exists()


def test_models_without_a_tokenizer_llama_cpp_reads_are_refused(tmp_path, tiny_model_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, _ = load_model(tiny_model_dir, None)
    with pytest.raises(ModelError, match="the model has no tokenizer, and a GGUF file must carry one"):
        export_pretrained(model, tmp_path / "hf", None, gguf_dir=tmp_path / "gguf")
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]")
    with pytest.raises(ModelError, match="the tokenizer is a WordPiece model; GGUF export handles BPE vocabularies"):
        export_pretrained(model, tmp_path / "hf", tokenizer, gguf_dir=tmp_path / "gguf")
    with pytest.raises(ModelError, match=r"types \['q4_k'\] must be one or more of f32, f16, bf16, q8_0"):
        export_pretrained(model, tmp_path / "hf", tokenizer, gguf_dir=tmp_path / "gguf", gguf_types=["q4_k"])
    assert not (tmp_path / "gguf").exists() and not (tmp_path / "hf").exists()


def test_export_params_ask_for_formats_users_expect():
    assert ExportParams().formats == ["hf"] and ExportParams(formats=["hf", "gguf"]).gguf_types == ["f16", "q8_0"]
    with pytest.raises(ValidationError, match="formats must include hf"):
        ExportParams(formats=["gguf"])
    with pytest.raises(ValidationError, match="gguf_types lists a type twice"):
        ExportParams(formats=["hf", "gguf"], gguf_types=["f16", "f16"])
    with pytest.raises(ValidationError, match="gguf_types"):
        ExportParams(gguf_types=["q4_k_m"])


# ---------------------------------------------------------------------------- through Kedro


@pytest.mark.slow
def test_export_pipeline_writes_gguf_and_a_modelfile(project):
    """`export.formats: [hf, gguf]` in a project copy: the tiny model after two SFT steps, as users run it."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(project)
    params = {"sft": {"max_steps": 2, "warmup_steps": 0, "checkpoint_every": 2}, "grpo": {"enabled": False},
              "preference": {"enabled": False}, "export": {"formats": ["hf", "gguf"], "gguf_types": ["q8_0", "bf16"]}}
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["ingest", "base_model", "format", "tokenize", "sft", "grpo", "export"])
    exported = json.loads((project / "data" / "06_models" / "exported_model.json").read_text())
    folder = project / "data" / "06_models" / "gguf"
    assert exported["gguf_dir"] == str(folder) and exported["checkpoint_step"] == 2
    assert sorted(p.name for p in folder.iterdir()) == [MODELFILE, "model-bf16.gguf", "model-q8_0.gguf"]
    assert (folder / MODELFILE).read_text().startswith("FROM ./model-q8_0.gguf\n")  # the first type listed
    reader = gguf.GGUFReader(folder / "model-q8_0.gguf")
    assert reader.fields["general.architecture"].contents() == "gemma"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"  # the tiny model's byte-level BPE
    assert "<start_of_turn>model" in reader.fields["tokenizer.chat_template"].contents()  # the turns it was tuned on
    weights = {t.name: t.tensor_type.name for t in reader.tensors}
    assert weights["blk.0.attn_q.weight"] == "Q8_0" and weights["blk.0.attn_norm.weight"] == "F32"
    hf = load_file(f"{exported['path']}/model.safetensors")
    bf16 = {t.name: t for t in gguf.GGUFReader(folder / "model-bf16.gguf").tensors}
    embed = gguf.dequantize(bf16["token_embd.weight"].data, bf16["token_embd.weight"].tensor_type)
    np.testing.assert_allclose(embed, hf["model.embed_tokens.weight"], rtol=2**-8, atol=0)  # bf16's rounding
    np.testing.assert_array_equal(bf16["output_norm.weight"].data, hf["model.norm.weight"] + 1)  # Gemma's 1 + w
    # and our own reader takes the file back as a model source: the same tokens as the exported tokenizer
    from transformers import AutoTokenizer

    from tunix_pipeline.models.gguf import gguf_to_folder

    back = AutoTokenizer.from_pretrained(gguf_to_folder(folder / "model-bf16.gguf", project / "read_back"))
    exported_tokenizer = AutoTokenizer.from_pretrained(exported["path"])
    texts = ["Gus has 36 apples. 36 - 18 = 18.", "  spaces,\tTabs\nand don't ünïcode 1234567"]
    assert [back(t).input_ids for t in texts] == [exported_tokenizer(t).input_ids for t in texts]
