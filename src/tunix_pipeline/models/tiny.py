"""A tiny Gemma-architecture model built offline: what `smoke` and the tests train."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GemmaConfig, PreTrainedTokenizerFast

from tunix_pipeline.config import TinyModelParams
from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.core.paths import atomic_folder

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def padded_vocab(tokens: int) -> int:
    """Embedding rows for `tokens` tokens: rounded up to a multiple of 64 (like Gemma's 256128 rows for
    256000 tokens), so the embedding shards evenly over the tensor-parallel axis."""
    return -(-tokens // 64) * 64


def hf_config(spec: TinyModelParams, vocab_size: int) -> dict:
    """The tiny model's config.json fields (the builder adds the tokenizer's special-token ids)."""
    return {
        "model_type": "gemma",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }


def build_tiny_gemma(out_dir: str | Path, corpus: Iterable[str], spec: TinyModelParams) -> Path:
    """A Gemma-architecture HF folder with random weights and a BPE tokenizer trained on `corpus`.

    Deterministic for the same corpus and spec; written to a temporary folder
    and moved into place, so a failure never leaves a half-written model.
    """
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
    fields = {k: v for k, v in hf_config(spec, padded_vocab(len(tokenizer))).items() if k != "model_type"}
    config = GemmaConfig(
        **fields,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    weights = random_gemma_weights(config, spec.seed)

    with atomic_folder(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)


def random_gemma_weights(config, seed: int) -> dict[str, np.ndarray]:
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
