import jax
import numpy as np
import pandas as pd
import pytest

from tunix_pipeline.config import RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.models import load_model
from tunix_pipeline.tokenization import tokenize_split
from tunix_pipeline.training import (
    MeshError,
    batches,
    completion_loss,
    evaluate_loss,
    global_batch_size,
    make_mesh,
    model_inputs,
    restore_latest,
    train,
)

MESH = RuntimeParams(mesh={"fsdp": 4, "tp": 2})


@pytest.fixture(scope="module")
def token_rows(tokenizer):
    prompts = [f"<bos><start_of_turn>user\nAda has {i} apples.<end_of_turn>\n<start_of_turn>model\n" for i in range(24)]
    completions = [f"<reasoning>{i} + 1 = {i + 1}.</reasoning><answer>{i + 1}</answer><end_of_turn>" for i in range(24)]
    frame = pd.DataFrame({"id": [str(i) for i in range(24)], "prompt": prompts, "completion": completions})
    rows, _ = tokenize_split(frame, tokenizer, TokenizeParams(max_length=48))
    return rows


def _sft(tmp_path, **kwargs):
    defaults = dict(
        max_steps=6, per_device_batch_size=1, learning_rate=1e-2, warmup_steps=1,
        checkpoint_every=3, checkpoint_dir=str(tmp_path / "ckpt"),
    )
    return SftParams(**{**defaults, **kwargs})


def test_mesh_from_config():
    assert dict(make_mesh(MESH).shape) == {"fsdp": 4, "tp": 2}
    assert dict(make_mesh(RuntimeParams(mesh="auto")).shape) == {"fsdp": 8, "tp": 1}
    with pytest.raises(MeshError, match=r"needs 6 devices but JAX sees 8.*runtime.mesh: auto"):
        make_mesh(RuntimeParams(mesh={"fsdp": 3, "tp": 2}))


def test_batches_are_fixed_size_seeded_and_cover_each_epoch(token_rows):
    first = list(batches(token_rows, 8, seed=0, epochs=2))
    again = list(batches(token_rows, 8, seed=0, epochs=2))
    assert len(first) == 6 and all(b["input_tokens"].shape == (8, 48) for b in first)
    assert all((a["input_tokens"] == b["input_tokens"]).all() for a, b in zip(first, again))
    epoch = np.concatenate([b["input_tokens"] for b in first[:3]])
    assert len({row.tobytes() for row in epoch}) == 24
    with pytest.raises(MeshError, match="24 training rows cannot fill one global batch of 32"):
        next(batches(token_rows, 32, seed=0))


def test_integer_label_loss_equals_tunix_default_loss(tiny_model_dir, token_rows):
    from tunix.sft.peft_trainer import _default_loss_fn

    model, _ = load_model(tiny_model_dir, None)
    batch = model_inputs(next(batches(token_rows, 4, seed=0)))
    ours = completion_loss(model, **batch)
    tunix = _default_loss_fn(
        model, batch["input_tokens"], batch["loss_mask"], batch["positions"], batch["attention_mask"]
    )
    np.testing.assert_allclose(ours, tunix, rtol=1e-5)
    assert 4.0 < float(ours) < 8.0  # about ln(vocab) for random weights


def test_eval_loss_does_not_depend_on_batch_padding(tiny_model_dir, token_rows):
    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh)
    rows = token_rows.head(20)  # 20 rows: padded batches at sizes 8 and 16
    a = evaluate_loss(model, rows, 8, mesh)
    b = evaluate_loss(model, rows, 16, mesh)
    assert a["tokens"] == b["tokens"] == int(np.stack(rows["loss_mask"]).astype(bool)[:, 1:].sum())
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_sft_trains_checkpoints_and_resumes(tiny_model_dir, token_rows, tmp_path):
    mesh = make_mesh(MESH)
    sft = _sft(tmp_path)
    assert global_batch_size(sft, mesh) == 4
    model, _ = load_model(tiny_model_dir, mesh)
    first = train(model, token_rows, token_rows.head(4), sft, mesh)
    assert (first["latest_step"], first["resumed_from_step"], first["steps_this_run"]) == (6, 0, 6)
    assert [h["step"] for h in first["loss_history"]] == [1, 2, 3, 4, 5, 6]
    assert first["last_loss"] < first["first_loss"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["3", "6"]

    # a rerun with a longer budget resumes from step 6 and keeps the whole curve
    model, _ = load_model(tiny_model_dir, mesh)
    second = train(model, token_rows, token_rows.head(4), _sft(tmp_path, max_steps=8), mesh)
    assert (second["resumed_from_step"], second["latest_step"], second["steps_this_run"]) == (6, 8, 2)
    assert [h["step"] for h in second["loss_history"]] == list(range(1, 9))
    assert second["loss_history"][:6] == first["loss_history"]

    fresh, _ = load_model(tiny_model_dir, mesh)
    assert restore_latest(fresh, tmp_path / "ckpt") == 8
    np.testing.assert_array_equal(fresh.embedder.input_embedding[...], model.embedder.input_embedding[...])
    assert not np.array_equal(
        fresh.embedder.input_embedding[...], load_model(tiny_model_dir, None)[0].embedder.input_embedding[...]
    )


def test_warmup_must_fit_in_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"warmup_steps \(6\) must be smaller than max_steps \(6\)"):
        _sft(tmp_path, warmup_steps=6)
