"""The tokenizer in a GGUF file's metadata, as llama.cpp's `convert_hf_to_gguf.py` writes it: vocabulary, merges or
sentencepiece scores, token types, special tokens, pre-tokenizer and chat template."""

from __future__ import annotations

import dataclasses
import json

import gguf

from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.models.gguf import PRE_TOKENIZERS

PIECE_COST = 2**23  # see _sentencepiece_scores; with fewer than 2**23 pieces every score is a float32 integer




@dataclasses.dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "llama" (SentencePiece-style BPE) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None  # tokenizer.ggml.pre: the split regex, by llama.cpp's name
    add_space_prefix: bool = False
    add_bos: bool = False
    add_eos: bool = False


def gguf_vocab(tokenizer, rows: int) -> Vocab:
    """The fast tokenizer's vocabulary as llama.cpp reads it, padded with unused tokens to the
    embedding's `rows` (as llama.cpp's converter pads)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE":
        raise ModelError(
            f"GGUF export: the tokenizer is a {model['type']} model; GGUF export handles BPE vocabularies "
            "(SentencePiece-style as Gemma's and Llama 2's, byte-level as Llama 3's and Qwen's): set export.formats: [hf]"
        )
    byte_level = _finds(spec.get("pre_tokenizer"), "ByteLevel") or _finds(spec.get("decoder"), "ByteLevel")
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    pieces = {i: t for t, i in model["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if max(pieces) >= rows:
        raise ModelError(f"GGUF export: the tokenizer has ids up to {max(pieces)} but the embedding only {rows} rows")
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(rows):
        if i not in pieces:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            special = added[i]["special"]
            # llama.cpp matches user-defined tokens in the raw text, so SentencePiece's spaces are spaces there
            tokens.append(pieces[i] if special or byte_level else pieces[i].replace("▁", " "))
            types.append(T.CONTROL if special else T.USER_DEFINED)
        elif not byte_level and len(pieces[i]) == 6 and pieces[i].startswith("<0x") and pieces[i].endswith(">"):
            tokens.append(pieces[i])
            types.append(T.BYTE)
        else:
            tokens.append(pieces[i])
            types.append(T.UNKNOWN if pieces[i] == model.get("unk_token") else T.NORMAL)
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges", [])]
    with_special = tokenizer("a", add_special_tokens=True).input_ids
    without = tokenizer("a", add_special_tokens=False).input_ids
    flags = dict(
        add_bos=tokenizer.bos_token_id is not None and with_special[:1] == [tokenizer.bos_token_id] != without[:1],
        add_eos=tokenizer.eos_token_id is not None and with_special[-1:] == [tokenizer.eos_token_id] != without[-1:],
    )
    if byte_level:
        encoded = [" ".join(p.replace(" ", "Ġ") for p in pair) for pair in merges]  # "Ġ": llama.cpp's space in merges
        return Vocab("gpt2", tokens, [int(t) for t in types], merges=encoded, pre=_pre_tokenizer(spec), **flags)
    if not model.get("byte_fallback"):
        raise ModelError(
            "GGUF export: the tokenizer is neither byte-level BPE nor SentencePiece-style BPE with byte fallback, "
            "the two kinds llama.cpp reads: set export.formats: [hf]"
        )
    return Vocab(
        "llama", tokens, [int(t) for t in types], scores=_sentencepiece_scores(tokens, types, merges),
        add_space_prefix=_prefixes_space(spec), **flags,
    )


def _sentencepiece_scores(tokens: list[str], types: list[int], merges: list[list[str]]) -> list[float]:
    """SentencePiece-style scores. llama.cpp joins the adjacent pair whose joined piece scores highest, so merged
    pieces score in the order of their first merge, and single characters below every merge (as in SentencePiece's
    own BPE models). Every piece also costs PIECE_COST: readers that take the scores as unigram log-probabilities
    (transformers) then prefer fewer pieces, as BPE's merges give, over early-merged short ones; llama.cpp
    compares scores only, so the constant changes nothing there. Bytes, control and unused tokens score 0."""
    first: dict[str, int] = {}
    for i, (left, right) in enumerate(merges):
        first.setdefault(left + right, i)
    order = {piece: n for n, piece in enumerate(sorted(first, key=first.__getitem__))}
    scores, chars = [], 0
    for token, kind in zip(tokens, types):
        if kind != gguf.TokenType.NORMAL:
            scores.append(0.0)
        elif token in order:
            scores.append(-float(PIECE_COST + order[token]))
        else:
            chars += 1
            scores.append(-float(PIECE_COST + len(order) + chars))
    return scores


def _finds(node, kind: str) -> bool:
    """Whether a tokenizer.json component (or one in its Sequence) is of `kind`."""
    if not isinstance(node, dict):
        return False
    return node.get("type") == kind or any(_finds(n, kind) for key in ("pretokenizers", "normalizers", "decoders")
                                           for n in node.get(key) or [])


def _pre_tokenizer(spec: dict) -> str:
    """llama.cpp's name for the byte-level tokenizer's split regex."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "gpt-2"  # GPT-2's own regex, inside ByteLevel
    patterns = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    names = {regex: name for name, regex in PRE_TOKENIZERS.items()}
    if len(patterns) == 1 and patterns[0] in names:
        return names[patterns[0]]
    raise ModelError(
        "GGUF export: the tokenizer splits text with a regex llama.cpp has no name for here "
        f"(supported: GPT-2's, and {', '.join(PRE_TOKENIZERS)}): set export.formats: [hf]"
    )


def _prefixes_space(spec: dict) -> bool:
    """Whether the SentencePiece-style tokenizer puts "▁" before the text (Llama 2 does, Gemma does not)."""
    normalizer, pre = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    if _finds(normalizer, "Prepend"):
        return True
    steps = pre.get("pretokenizers", [pre])
    return any(s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never" for s in steps)


def add_vocab(w, vocab: Vocab, tokenizer, template: str | None) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
        w.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if token_id is not None:
            getattr(w, f"add_{kind}_token_id")(token_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if template:
        w.add_chat_template(template)
