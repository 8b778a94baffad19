"""Parity with transformers' own PyTorch models: the reference every family is tested against.

Tiny random models are built by transformers from a config, saved as a normal
Hugging Face folder, and loaded by `load_pretrained`. PyTorch is a test-only
dependency (`torch==2.13.0`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

from tunix_pipeline.models import compute_logits, load_pretrained

EPS = float(np.finfo(np.float32).eps)
# a fixed bound for callers without the model's config at hand; `logits_atol` derives one from the model
ATOL = 1e-4


def logits_atol(folder: Path, reference: np.ndarray) -> float:
    """How far two float32 evaluations of the model in `folder` may differ, from the math.

    They compute the same function in another order (kernels, fusions, vector width, sharding).
    A length-n dot product is off by at most n * eps relative to the size of its terms; each of the
    L layers and the output projection adds one such error to the (normalised) residual stream, so a
    logit moves by at most about (L + 1) * n * eps * max|logit|, n the longest reduction (hidden or
    MLP width). For the tiny test models that is ~5e-4; measured differences are ~1e-5 or less, and a
    wrongly mapped weight, norm or position moves logits by ~0.1 or more.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)
    width = max(config["hidden_size"], config["intermediate_size"])
    return (config["num_hidden_layers"] + 1) * width * EPS * float(np.abs(reference).max())


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


def assert_logits_match(folder: Path, tokens: np.ndarray, mask: np.ndarray) -> None:
    """Our fp32 logits equal transformers' at every non-pad position, within `logits_atol`."""
    model, _ = load_pretrained(folder)
    ours = compute_logits(model, tokens, mask)
    theirs = reference_logits(folder, tokens, mask)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=logits_atol(folder, theirs[real]), rtol=0)


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
    # equal tokens are a sound test only where no choice is a near-tie: every step's top two logits
    # are further apart than twice the error bound, so rounding cannot flip a token on another CPU
    tokens = np.asarray([list(prompt) + ours], dtype=np.int32)
    logits = compute_logits(model, tokens, np.ones_like(tokens))[0, len(prompt) - 1 : -1]
    top_two = np.sort(logits, axis=-1)[:, -2:]
    assert (top_two[:, 1] - top_two[:, 0]).min() > 2 * logits_atol(folder, logits)
