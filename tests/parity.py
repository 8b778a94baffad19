"""Parity with transformers' own PyTorch models: the reference every family is tested against.

Tiny random models are built by transformers from a config, saved as a normal
Hugging Face folder, and loaded by `load_pretrained`. PyTorch is a test-only
dependency (`torch==2.13.0`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from tunix_pipeline.models import compute_logits, load_pretrained

ATOL = 1e-4


def save_hf_model(config: transformers.PretrainedConfig, folder: Path, seed: int = 0) -> Path:
    """A random transformers model for `config`, saved to `folder` (fp32 safetensors).

    Norm weights are randomised too: transformers initialises them to constants,
    which would hide a norm mapped to the wrong place.
    """
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.eval()
    model.save_pretrained(folder)
    return Path(folder)


def sample_batch(vocab_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two right-padded rows: one full (12 tokens), one with 7 tokens then padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, size=(2, 12)).astype(np.int32)
    mask = np.ones((2, 12), dtype=np.int32)
    mask[1, 7:] = 0
    tokens[1, 7:] = 0
    return tokens, mask


def reference_logits(folder: Path, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def assert_logits_match(folder: Path, tokens: np.ndarray, mask: np.ndarray, atol: float = ATOL) -> None:
    """Our fp32 logits equal transformers' at every non-pad position."""
    model, _ = load_pretrained(folder)
    ours = compute_logits(model, tokens, mask)
    theirs = reference_logits(folder, tokens, mask)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=atol, rtol=0)


def greedy_ours(model, prompt: np.ndarray, steps: int) -> list[int]:
    """Greedy decoding without a cache, in one fixed shape (right padding): one compile for every step."""
    total = len(prompt) + steps
    tokens = np.zeros((1, total), dtype=np.int32)
    tokens[0, : len(prompt)] = prompt
    for n in range(len(prompt), total):
        mask = (np.arange(total) < n).astype(np.int32)[None]
        tokens[0, n] = int(compute_logits(model, tokens, mask)[0, n - 1].argmax())
    return tokens[0, len(prompt) :].tolist()


def assert_greedy_match(folder: Path, prompt: np.ndarray, steps: int = 16) -> None:
    """16 greedy tokens, ours and transformers' generate(), identical."""
    model, _ = load_pretrained(folder)
    ours = greedy_ours(model, prompt, steps)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    assert ours == out[0, len(prompt) :].tolist()
