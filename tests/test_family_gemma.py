"""Gemma (1) checkpoints: logits and greedy tokens equal to transformers'."""

import pytest
import transformers

from .parity import assert_greedy_match, assert_logits_match, sample_batch, save_hf_model


def _config(**overrides):
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, pad_token_id=0,
    )
    return transformers.GemmaConfig(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 4}, {"num_key_value_heads": 2}],
    ids=["mqa", "mha", "gqa"],
)
def test_gemma_logits_match_transformers(tmp_path, overrides):
    folder = save_hf_model(_config(**overrides), tmp_path / "gemma")
    tokens, mask = sample_batch(256)
    assert_logits_match(folder, tokens, mask)


def test_gemma_greedy_generation_matches_transformers(tmp_path):
    folder = save_hf_model(_config(), tmp_path / "gemma")
    assert_greedy_match(folder, sample_batch(256)[0][0, :5])
