"""Checkpoints out: LoRA / QLoRA, training, and export to folders transformers loads."""

import json

import numpy as np
import pandas as pd
import pytest
import transformers
from flax import nnx

from tunix_pipeline.config import LoraParams, RuntimeParams, SftParams
from tunix_pipeline.models import (
    ModelError,
    apply_lora,
    compute_logits,
    export_pretrained,
    load_model,
    load_pretrained,
    parameter_counts,
)
from tunix_pipeline.models.families import family_for
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.train.sft import train

from .parity import logits_atol, reference_logits, sample_batch, save_hf_model

MESH = RuntimeParams(mesh={"fsdp": 4, "tp": 2})
GEMMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return save_hf_model(transformers.GemmaConfig(**GEMMA), tmp_path_factory.mktemp("hf") / "gemma")


def _rows(n=16, length=24, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.tile(rng.integers(3, 256, size=length), (n, 1)).astype(np.int32)  # learnable: one sequence
    loss = np.zeros_like(tokens)
    loss[:, length // 2 :] = 1
    return pd.DataFrame(
        {"id": [str(i) for i in range(n)], "input_tokens": list(tokens), "loss_mask": list(loss),
         "segment_ids": list(np.ones_like(tokens)), "positions": list(np.tile(np.arange(length), (n, 1)))}
    )


def _train(model, mesh, tmp_path, steps=3):
    sft = SftParams(max_steps=steps, per_device_batch_size=1, learning_rate=5e-3, checkpoint_every=steps,
                    checkpoint_dir=str(tmp_path / "ckpt"))
    return train(model, _rows(), _rows(4), sft, mesh)


def _assert_transformers_agrees(model, folder):
    tokens, mask = sample_batch(256, seed=1)
    theirs = reference_logits(folder, tokens, mask)[mask.astype(bool)]
    np.testing.assert_allclose(
        compute_logits(model, tokens, mask)[mask.astype(bool)], theirs, atol=logits_atol(folder, theirs), rtol=0
    )


@pytest.mark.slow
def test_full_fine_tune_exports_a_folder_transformers_loads(gemma_dir, tmp_path):
    mesh = make_mesh(MESH)
    model, tokenizer = load_pretrained(gemma_dir, mesh)
    assert tokenizer is None  # transformers-made test folders have no tokenizer
    before = compute_logits(model, *sample_batch(256))
    result = _train(model, mesh, tmp_path)
    assert result["last_loss"] < result["first_loss"]
    assert not np.allclose(before, compute_logits(model, *sample_batch(256)))  # training moved them by far more
    out = export_pretrained(model, tmp_path / "export")
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    _assert_transformers_agrees(model, out)


@pytest.mark.slow
def test_lora_training_updates_only_adapters_and_exports_merged(gemma_dir, tmp_path):
    mesh = make_mesh(MESH)
    model, _ = load_model(gemma_dir, mesh)
    lora = LoraParams(rank=4, alpha=8.0)
    model = apply_lora(model, lora, mesh)
    counts = parameter_counts(model)
    assert 0 < counts["trainable_params"] < counts["total_params"] / 5
    base = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
            if not isinstance(v, nnx.LoRAParam)}
    _train(model, mesh, tmp_path)
    after = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
             if not isinstance(v, nnx.LoRAParam)}
    # bitwise: frozen weights are never written, not even with a rounding error
    assert all(np.array_equal(base[k], after[k]) for k in base), "LoRA training changed a base weight"
    checkpoint = tmp_path / "ckpt" / "3" / "model_params"
    assert checkpoint.is_dir()
    saved = (checkpoint / "_METADATA").read_text()  # Orbax's tree of saved arrays
    assert "lora_a" in saved and "embedder" not in saved, "a LoRA run must checkpoint only its adapters"

    with pytest.raises(ModelError, match="pass their alpha"):
        export_pretrained(model, tmp_path / "nope")
    out = export_pretrained(model, tmp_path / "export", lora_alpha=lora.alpha)
    _assert_transformers_agrees(model, out)


@pytest.mark.slow
def test_qlora_trains_on_an_nf4_base(gemma_dir, tmp_path):
    mesh = make_mesh(MESH)
    model, _ = load_model(gemma_dir, mesh)
    model = apply_lora(model, LoraParams(rank=4, alpha=8.0, quantize="nf4"), mesh)
    dtypes = {str(v[...].dtype) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "uint4" in dtypes
    result = _train(model, mesh, tmp_path, steps=4)
    assert result["last_loss"] < result["first_loss"]


def test_sharded_export_and_sharded_load(gemma_dir, tmp_path):
    model, _ = load_model(gemma_dir, None)
    out = export_pretrained(model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    _assert_transformers_agrees(model, out)
    reloaded, _ = load_model(out, make_mesh(MESH))
    tokens, mask = sample_batch(256)
    before = compute_logits(model, tokens, mask)
    # the same weights on a (4, 2) mesh: another summation order, bounded as for two implementations
    np.testing.assert_allclose(compute_logits(reloaded, tokens, mask), before, atol=logits_atol(out, before), rtol=0)


def test_bf16_loads_and_exports_in_bf16(gemma_dir, tmp_path):
    model, _ = load_model(gemma_dir, None, dtype="bfloat16")
    assert str(model.embedder.input_embedding[...].dtype) == "bfloat16"
    out = export_pretrained(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    import torch

    assert transformers.AutoModelForCausalLM.from_pretrained(out).model.embed_tokens.weight.dtype == torch.bfloat16


def test_float32_masters_ship_in_bf16(gemma_dir, tmp_path):
    """export.dtype: bfloat16 writes the float32 weights rounded to bf16, half the bytes; GGUF is not affected."""
    import ml_dtypes
    from safetensors.numpy import load_file

    model, _ = load_model(gemma_dir, None)
    trained = load_file(str(export_pretrained(model, tmp_path / "f32") / "model.safetensors"))
    out = export_pretrained(model, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    shipped = load_file(str(out / "model.safetensors"))
    assert shipped.keys() == trained.keys()
    for name, weights in trained.items():
        assert shipped[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(shipped[name], weights.astype(ml_dtypes.bfloat16))


GEMMA_2B = {  # google/gemma-2b config.json (as of 2024-2026)
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "vocab_size": 256000, "hidden_size": 2048,
    "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 256, "hidden_act": "gelu", "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "max_position_embeddings": 8192, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


def test_abstract_gemma_2b_has_the_hub_parameter_count():
    family = family_for(GEMMA_2B)
    cfg = family.config_from_hf(GEMMA_2B)
    abstract = nnx.eval_shape(lambda: family.model_class(cfg, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in __import__("jax").tree.leaves(nnx.state(abstract, nnx.Param)))
    d, f, layers, v = 2048, 16384, 18, 256000
    q, kv = 8 * 256, 1 * 256
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
    assert count == v * d + layers * per_layer + d == 2_506_172_416


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, attn_logit_softcapping=None, sliding_window=4),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**SMALL, sliding_window=4, query_pre_attn_scalar=16),
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_exports_merged_lora_that_transformers_loads(family, tmp_path):
    folder = save_hf_model(FAMILIES[family](), tmp_path / family)
    model, _ = load_model(folder, None)
    lora = LoraParams(rank=4, alpha=8.0)
    model = apply_lora(model, lora)
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # adapters that change the output
        if str(path[-1]).endswith("lora_b"):
            value[...] = np.random.default_rng(len(path)).normal(0, 0.05, value[...].shape).astype(np.float32)
    out = export_pretrained(model, tmp_path / "export", lora_alpha=lora.alpha)
    _assert_transformers_agrees(model, out)
