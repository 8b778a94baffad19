import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from tunix_pipeline.config import ModelParams, RuntimeParams, TinyModelParams
from tunix_pipeline.models import ModelError, build_tiny_gemma, load_model, resolve_model_dir
from tunix_pipeline.core.runtime import make_mesh

CORPUS = ["Ada has 3 apples. 3 + 1 = 4.", "<reasoning>2 * 3 = 6</reasoning><answer>6</answer>"] * 20


def test_tiny_model_is_a_deterministic_hf_folder(tmp_path):
    a = build_tiny_gemma(tmp_path / "a", CORPUS, TinyModelParams(vocab_size=320))
    b = build_tiny_gemma(tmp_path / "b", CORPUS, TinyModelParams(vocab_size=320))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "gemma" and config["vocab_size"] % 64 == 0
    assert not list(tmp_path.glob(".a.*")), "temporary build folder left behind"


def test_loaded_weights_are_the_checkpoints_with_gemma1_norms_in_place(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    # distinctive norms: Gemma 1's post_attention_layernorm is the pre-MLP norm
    rng = np.random.default_rng(0)
    weights["model.layers.1.post_attention_layernorm.weight"] = rng.normal(size=64).astype(np.float32)
    weights["model.layers.1.input_layernorm.weight"] = rng.normal(size=64).astype(np.float32)
    from safetensors.numpy import save_file

    save_file(weights, str(folder / "model.safetensors"))
    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    model, cfg = load_model(folder, mesh)
    layer = model.layers[1]
    # loading copies, reshapes and transposes the checkpoint's tensors: no arithmetic, so bitwise
    np.testing.assert_array_equal(layer.pre_ffw_norm.scale[...], weights["model.layers.1.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(layer.pre_attention_norm.scale[...], weights["model.layers.1.input_layernorm.weight"])
    np.testing.assert_array_equal(model.embedder.input_embedding[...], weights["model.embed_tokens.weight"])
    q = weights["model.layers.1.self_attn.q_proj.weight"].T.reshape(cfg.embed_dim, cfg.num_heads, cfg.head_dim)
    np.testing.assert_array_equal(layer.attn.q_einsum.w[...], q.transpose(1, 0, 2))
    down = weights["model.layers.1.mlp.down_proj.weight"].T
    np.testing.assert_array_equal(layer.mlp.down_proj.kernel[...], down)
    assert tuple(model.embedder.input_embedding[...].sharding.spec) == ("tp", "fsdp")


def test_unsupported_or_incomplete_folders_are_refused(tiny_model_dir, tmp_path):
    llama = tmp_path / "llama"
    shutil.copytree(tiny_model_dir, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ModelError, match="model_type .gpt_neox. is not supported; supported: "):
        load_model(llama, None)
    (llama / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"not a Hugging Face model folder: missing \*\.safetensors"):
        load_model(llama, None)


def test_mesh_that_the_model_cannot_shard_over(tiny_model_dir):
    with pytest.raises(ModelError, match="num_heads=4 is not divisible by tp=8"):
        load_model(tiny_model_dir, make_mesh(RuntimeParams(mesh={"fsdp": 1, "tp": 8})))


def test_model_sources(tiny_model_dir, tmp_path, monkeypatch):
    assert resolve_model_dir(ModelParams(source=str(tiny_model_dir))) == tiny_model_dir
    with pytest.raises(ModelError, match="model folder not found"):
        resolve_model_dir(ModelParams(source=str(tmp_path / "missing")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=r"(?s)could not download 'google/gemma-2b'.*HF_TOKEN"):
        resolve_model_dir(ModelParams(source="google/gemma-2b"))


def test_credentials_file_feeds_the_hub_clients(project, monkeypatch):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    for variable in ("HF_TOKEN", "KAGGLE_USERNAME"):  # recorded, so the test's changes are undone
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    monkeypatch.setenv("KAGGLE_KEY", "from-env")
    (project / "conf" / "local" / "credentials.yml").write_text(
        "huggingface:\n  token: hf_test\nkaggle:\n  username: me\n  key: from-file\n"
    )
    bootstrap_project(project)
    with KedroSession.create(project_path=project) as session:
        session.load_context()
    import os

    assert os.environ["HF_TOKEN"] == "hf_test" and os.environ["KAGGLE_USERNAME"] == "me"
    assert os.environ["KAGGLE_KEY"] == "from-env"  # the environment wins


def test_a_weight_missing_from_the_checkpoint_is_named(tmp_path):
    import transformers

    from .parity import save_hf_model

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    folder = save_hf_model(config, tmp_path / "llama")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": False}))
    with pytest.raises(ModelError, match="no weights for lm_head"):
        load_model(folder, None)


def test_a_loaded_models_training_flops_follow_its_own_remat_and_lora(tiny_model_dir):
    """What the throughput lines count per token: the plan's count for the model as the run built it."""
    from tunix_pipeline.config import LoraParams
    from tunix_pipeline.models import load_run_model
    from tunix_pipeline.models.architecture import from_tunix_config, model_flops_per_token

    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    plain, _ = load_model(tiny_model_dir, mesh)
    recomputed, _ = load_model(tiny_model_dir, mesh, remat="decoder")
    arch = from_tunix_config(plain.config)
    assert model_flops_per_token(plain, 64) == arch.train_flops_per_token(64, "full", "none")
    # a second forward pass: 4 passes of the layers where 3 were counted
    assert model_flops_per_token(recomputed, 64) == pytest.approx(model_flops_per_token(plain, 64) * 4 / 3)
    lora, _ = load_run_model(tiny_model_dir, ModelParams(source=str(tiny_model_dir), lora=LoraParams(rank=4)), mesh,
                             remat="attention")
    assert model_flops_per_token(lora, 64) == arch.train_flops_per_token(64, "lora", "attention")
