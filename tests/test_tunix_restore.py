"""The final checkpoint restores as Tunix's own examples and the Kaggle hackathon's notebooks restore one.

Their recipe (Tunix's GRPO demo, docs/restore_with_tunix.md): full weights into the abstract model that
`nnx.eval_shape` builds from Tunix's `ModelConfig`, through `orbax.checkpoint.StandardCheckpointer`;
LoRA adapters through qwix's `LoraProvider` on the base model, then the same restore of the
`nnx.LoRAParam` state. Nothing of ours is on that path: only the folder our export names
(`exported_model.json`'s `checkpoint`), which each test checks is where Tunix wrote it.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pandas as pd
import pytest
import qwix
import transformers
from flax import nnx
from tunix.models.gemma import model as gemma_lib
from tunix.models.gemma import params_safetensors as gemma_safetensors
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.gemma3 import params_safetensors as gemma3_safetensors

from tunix_pipeline.config import (
    ExportParams, FormatParams, GrpoParams, LoraParams, ModelParams, RuntimeParams, SftParams,
)
from tunix_pipeline.models import apply_lora, compute_logits, load_model
from tunix_pipeline.models.families.gemma2 import Gemma2
from tunix_pipeline.models.families.gemma3 import Gemma3Text
from tunix_pipeline.pipelines.export.nodes import export_model
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.train.grpo import prepare, train_grpo
from tunix_pipeline.train.sft import train

from .parity import logits_atol, sample_batch, save_hf_model

RUNTIME = RuntimeParams(mesh={"fsdp": 4, "tp": 2})
LORA = LoraParams(rank=4, alpha=8.0)


def distinct_chars(prompts, completions, **columns):
    """A GRPO reward (by dotted path) that differs between random completions, so that the step moves the adapters."""
    return [len(set(c)) / 10 for c in completions]


# ---------------------------------------------------------------- our side: train, then export names the checkpoint
def _rows(n=16, length=24):
    tokens = np.tile(np.random.default_rng(0).integers(3, 256, size=length), (n, 1)).astype(np.int32)
    loss = np.zeros_like(tokens)
    loss[:, length // 2 :] = 1
    return pd.DataFrame({"id": [str(i) for i in range(n)], "input_tokens": list(tokens), "loss_mask": list(loss),
                         "segment_ids": list(np.ones_like(tokens)), "positions": list(np.tile(np.arange(length), (n, 1)))})


def _sft(model_dir, tmp_path, lora: LoraParams | None):
    """The model trained by our SFT (3 steps, a checkpoint at the last), and what `sft.train` returns."""
    mesh = make_mesh(RUNTIME)
    model, _ = load_model(model_dir, mesh)
    if lora is not None:
        model = apply_lora(model, lora, mesh)
    sft = SftParams(max_steps=3, per_device_batch_size=1, learning_rate=5e-3, checkpoint_every=3,
                    checkpoint_dir=str(tmp_path / "sft_checkpoints"))
    return model, train(model, _rows(), _rows(4), sft, mesh)


def _exported_checkpoint(model_dir, tmp_path, lora, sft_result, grpo_result=None) -> str:
    """The final checkpoint's Orbax folder, as our export node names it in `exported_model.json`."""
    exported = export_model(
        {"path": str(model_dir)}, ModelParams(lora=lora), ExportParams(output_dir=str(tmp_path / "exported")), RUNTIME,
        FormatParams(), sft_result=sft_result, preference_result={"enabled": False},
        grpo_result=grpo_result or {"enabled": False},
    )
    return exported["checkpoint"]


def _weights(model, kind=nnx.Param) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.array(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, kind))}


def _assert_same_model(restored, trained, model_dir):
    got, expected = _weights(restored), _weights(trained)
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[k], expected[k]) for k in expected), "a restored weight differs"
    tokens, mask = sample_batch(256)
    real = mask.astype(bool)  # padding's logits are nobody's
    theirs = compute_logits(trained, tokens, mask)[real]
    np.testing.assert_allclose(compute_logits(restored, tokens, mask)[real], theirs, rtol=0,
                               atol=logits_atol(model_dir, theirs))


# ---------------------------------------------------------------- the notebook's side: Tunix, qwix and Orbax only
def _tunix_gemma_config(model_dir) -> gemma_lib.ModelConfig:
    """Tunix's Gemma config for the tiny model, written out as a notebook would for its model."""
    hf = json.loads((model_dir / "config.json").read_text())
    return gemma_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], num_embed=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], final_logit_softcap=None, use_post_attn_norm=False,
        use_post_ffw_norm=False, attention_types=(gemma_lib.AttentionType.GLOBAL,) * hf["num_hidden_layers"],
    )


def restore_full(model_cls, config, path, mesh):
    """Full weights: the abstract model from its config, then Orbax restores every weight onto the mesh."""
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(params=0)))
    state = nnx.state(abstract)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=s),
                          state, nnx.get_named_sharding(state, mesh))
    restored = ocp.StandardCheckpointer().restore(path, target=target)
    return nnx.merge(nnx.graphdef(abstract), restored)


def restore_lora(base, lora: LoraParams, path, mesh):
    """LoRA: qwix puts the adapters on the base model, then Orbax restores them (as Tunix's GRPO demo does)."""
    provider = qwix.LoraProvider(module_path=lora.target_modules, rank=lora.rank, alpha=lora.alpha)
    with mesh:
        model = qwix.apply_lora_to_model(base, provider, **base.get_model_input(), rngs=nnx.Rngs(0))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(model, nnx.LoRAParam))
    nnx.update(model, ocp.StandardCheckpointer().restore(path, target=target))
    return model


# ---------------------------------------------------------------- the tiny Gemma of `smoke`
def test_full_weights_restore_into_tunix_gemma(tiny_model_dir, tmp_path):
    trained, sft_result = _sft(tiny_model_dir, tmp_path, lora=None)
    path = _exported_checkpoint(tiny_model_dir, tmp_path, None, sft_result)
    assert path == str(tmp_path / "sft_checkpoints" / "3" / "model_params")

    mesh = make_mesh(RUNTIME)
    restored = restore_full(gemma_lib.Gemma, _tunix_gemma_config(tiny_model_dir), path, mesh)
    assert type(restored) is gemma_lib.Gemma
    _assert_same_model(restored, trained, tiny_model_dir)

    # the check can fail: a model with a post-MLP norm (as Gemma 2 has) has a weight the file lacks
    gemma2_like = dataclasses.replace(_tunix_gemma_config(tiny_model_dir), use_post_ffw_norm=True)
    with pytest.raises(ValueError):
        restore_full(gemma_lib.Gemma, gemma2_like, path, mesh)


@pytest.mark.slow
def test_lora_after_grpo_restores_onto_the_base_with_qwix(tiny_model_dir, tokenizer, tmp_path):
    """The hackathon's chain ends in GRPO on LoRA adapters: its checkpoint holds only the adapters."""
    trained, sft_result = _sft(tiny_model_dir, tmp_path, LORA)
    n = 8
    formatted = pd.DataFrame({
        "id": [f"r{i}" for i in range(n)], "source": ["t"] * n, "answer": [str(i) for i in range(n)],
        "prompt": [f"<bos><start_of_turn>user\nAda has {i} apples.<end_of_turn>\n<start_of_turn>model\n" for i in range(n)],
        "completion": [f"<reasoning>{i}</reasoning><answer>{i}</answer><end_of_turn>" for i in range(n)],
    })
    grpo = GrpoParams(enabled=True, max_steps=1, batch_size=2, num_generations=2, max_prompt_length=32,
                      max_completion_length=8, learning_rate=1e-2, beta=0.0, checkpoint_every=1, max_prompts=2,
                      checkpoint_dir=str(tmp_path / "grpo_checkpoints"),
                      rewards=[{"fn": "tests.test_tunix_restore:distinct_chars"}])
    adapters_after_sft = _weights(trained, nnx.LoRAParam)
    mesh = make_mesh(RUNTIME)
    grpo_result = {**train_grpo(trained, tokenizer, prepare(formatted, tokenizer, grpo, mesh), grpo, mesh),
                   "start_checkpoint_dir": sft_result["checkpoint_dir"], "start_step": sft_result["latest_step"]}
    path = _exported_checkpoint(tiny_model_dir, tmp_path, LORA, sft_result, grpo_result)
    assert path == str(tmp_path / "grpo_checkpoints" / "actor" / "1" / "model_params")
    adapters = _weights(trained, nnx.LoRAParam)
    assert any(not np.array_equal(adapters[k], adapters_after_sft[k]) for k in adapters)  # GRPO's, not SFT's

    # the base is the folder the run started from; Tunix's own Gemma 1 safetensors reader mismaps its pre-MLP
    # norm (docs/upstream_tunix.md), so here it is loaded by ours; the Gemma 2 and 3 tests below use Tunix's
    mesh = make_mesh(RUNTIME)
    base, _ = load_model(tiny_model_dir, mesh)
    restored = restore_lora(base, LORA, path, mesh)
    assert _weights(restored, nnx.LoRAParam).keys() == adapters.keys()
    _assert_same_model(restored, trained, tiny_model_dir)

    # the check can fail: adapters of another rank do not fit the file
    base, _ = load_model(tiny_model_dir, mesh)
    with pytest.raises(ValueError):
        restore_lora(base, LORA.model_copy(update={"rank": 8}), path, mesh)


# ---------------------------------------------------------------- Gemma 2 and 3 (the hackathon's gemma-2-2b-it, gemma-3-1b-it)
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
             query_pre_attn_scalar=16, sliding_window=4, pad_token_id=0)
FAMILIES = {
    # (transformers' config, Tunix's model class, Tunix's config of it, Tunix's safetensors reader)
    "gemma2": (  # gemma-2-2b's shape in small: local and global layers alternate, both softcaps
        transformers.Gemma2Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2,
                                  layer_types=["sliding_attention", "full_attention"]),
        gemma_lib.Gemma,
        gemma_lib.ModelConfig(
            num_layers=2, num_embed=256, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2,
            final_logit_softcap=30.0, use_post_attn_norm=True, use_post_ffw_norm=True, attn_logits_soft_cap=50.0,
            attention_types=(gemma_lib.AttentionType.LOCAL_SLIDING, gemma_lib.AttentionType.GLOBAL), sliding_window_size=4,
        ),
        gemma_safetensors,
    ),
    "gemma3": (  # gemma-3-1b's shape in small: 5 local layers then a global one, as Tunix's Gemma 3 cycles them
        transformers.Gemma3TextConfig(
            **SMALL, num_hidden_layers=6, num_key_value_heads=1, layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        ),
        gemma3_lib.Gemma3,
        gemma3_lib.ModelConfig(
            num_layers=6, num_embed=256, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=1,
            sliding_window_size=4, local_base_frequency=10_000, global_base_frequency=1_000_000, param_dtype=jnp.float32,
        ),
        gemma3_safetensors,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "lora"), [("gemma3", None), ("gemma3", LORA), ("gemma2", LORA)],
                         ids=["gemma3-full", "gemma3-lora", "gemma2-lora"])
def test_gemma2_and_gemma3_restore_into_tunix_own_classes(family, lora, tmp_path):
    hf_config, model_cls, config, reader = FAMILIES[family]
    model_dir = save_hf_model(hf_config, tmp_path / family)
    trained, sft_result = _sft(model_dir, tmp_path, lora)
    path = _exported_checkpoint(model_dir, tmp_path, lora, sft_result)
    assert path == str(tmp_path / "sft_checkpoints" / "3" / "model_params")
    mesh = make_mesh(RUNTIME)
    if lora is None:
        restored = restore_full(model_cls, config, path, mesh)
    else:  # the base through Tunix's own safetensors reader, as a notebook loads the hub's model
        restored = restore_lora(reader.create_model_from_safe_tensors(str(model_dir), config, mesh, dtype=jnp.float32),
                                lora, path, mesh)
    # Tunix's own class, not our subclass (which takes the checkpoint's layer pattern and query scale)
    assert isinstance(restored, model_cls) and not isinstance(restored, (Gemma2, Gemma3Text))
    _assert_same_model(restored, trained, model_dir)
