import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from flax import nnx

from tunix_pipeline.config import RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.data.tokenization import token_arrays, tokenize_split
from tunix_pipeline.evaluate.evaluation import evaluate_loss
from tunix_pipeline.models import compute_logits, load_model
from tunix_pipeline.core.runtime import MeshError, global_batch_size, make_mesh, process_rows
from tunix_pipeline.train.checkpoints import HISTORY_FILE, SECONDS_FILE, TrainClock, load_history, restore_latest
from tunix_pipeline.train.loop import BatchFeed
from tunix_pipeline.train.loss import completion_loss, model_inputs
from tunix_pipeline.train.loop import make_optimizer
from tunix_pipeline.train.sft import train

from .conftest import ROOT
from .parity import EPS, logits_atol

MESH = RuntimeParams(mesh={"fsdp": 4, "tp": 2})
WORKER = str(ROOT / "tests" / "train_worker.py")


@pytest.fixture(scope="module")
def formatted():
    prompts = [f"<bos><start_of_turn>user\nAda has {i} apples.<end_of_turn>\n<start_of_turn>model\n" for i in range(24)]
    completions = [f"<reasoning>{i} + 1 = {i + 1}.</reasoning><answer>{i + 1}</answer><end_of_turn>" for i in range(24)]
    return pd.DataFrame({"id": [str(i) for i in range(24)], "prompt": prompts, "completion": completions})


@pytest.fixture(scope="module")
def token_rows(tokenizer, formatted):
    return tokenize_split(formatted, tokenizer, TokenizeParams(max_length=48))[0]


@pytest.fixture(scope="module")
def rows_file(token_rows, tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    token_rows.to_parquet(path)
    return path


def _sft(tmp_path, **kwargs):
    defaults = dict(
        max_steps=6, per_device_batch_size=1, learning_rate=1e-2, warmup_steps=1,
        checkpoint_every=3, checkpoint_dir=str(tmp_path / "ckpt"),
    )
    return SftParams(**{**defaults, **kwargs})


def _params(model):
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _batch(rows, n=4):
    return model_inputs({k: jnp.asarray(v[:n]) for k, v in token_arrays(rows).items()})


# ---------------------------------------------------------------- tolerances, from float32 rounding
# for two computations of one quantity that differ only in the order of their float32 operations
# (chunks, micro-batches, shardings, processes, another CPU's vector width)
def _completion_tokens(batch) -> int:
    return int(np.asarray(batch["loss_mask"])[:, 1:].sum())


def _assert_gradients_close(got, expected, terms: int) -> None:
    """Each gradient entry is a sum over the `terms` positions of a batch; reordering a sum of n terms
    moves it by at most n * eps * sum|terms|. sum|terms| is not at hand: the tensor's largest entry
    stands in for it, the worst-case n covering the cancellation (measured differences: <= 5 eps)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=terms * EPS * float(np.abs(b).max()))


def _mean_nll_atol(model_dir, model, rows, mean: float) -> float:
    """Two programs' `mean` completion NLL over `rows`: a token's NLL moves by at most twice its largest
    logit error (its gradient in the logits has L1 norm <= 2), bounded by `parity.logits_atol`; the
    mean over n tokens adds n * eps relative."""
    arrays = token_arrays(rows)
    logits = compute_logits(model, arrays["input_tokens"], (arrays["segment_ids"] > 0).astype(np.int32))
    return 2 * logits_atol(model_dir, logits) + int(arrays["loss_mask"].sum()) * EPS * mean


# ---------------------------------------------------------------- mesh and data
def test_mesh_from_config():
    assert dict(make_mesh(MESH).shape) == {"data": 1, "fsdp": 4, "tp": 2}
    assert dict(make_mesh(RuntimeParams(mesh="auto")).shape) == {"data": 1, "fsdp": 8, "tp": 1}
    mesh = make_mesh(RuntimeParams(mesh={"data": 2, "fsdp": 2, "tp": 2}))
    assert global_batch_size(_sft(__import__("pathlib").Path("/tmp"), per_device_batch_size=3), mesh) == 12
    with pytest.raises(MeshError, match=r"needs 6 devices but JAX sees 8.*runtime.mesh: auto"):
        make_mesh(RuntimeParams(mesh={"fsdp": 3, "tp": 2}))
    assert process_rows(mesh, 12) == slice(0, 12)  # one process feeds every row


def test_batches_are_a_pure_function_of_the_step(token_rows):
    feed = BatchFeed(token_rows, 8, seed=0)
    again = BatchFeed(token_rows, 8, seed=0)
    assert all((feed.batch(i)["input_tokens"] == again.batch(i)["input_tokens"]).all() for i in range(6))
    assert feed.batch(0)["input_tokens"].shape == (8, 48)
    epoch = np.concatenate([feed.batch(i)["input_tokens"] for i in range(3)])
    assert len({row.tobytes() for row in epoch}) == 24
    assert not (feed.batch(3)["input_tokens"] == feed.batch(0)["input_tokens"]).all()  # a new epoch reshuffles
    with pytest.raises(MeshError, match="24 training rows cannot fill one global batch of 32"):
        BatchFeed(token_rows, 32, seed=0)


# ---------------------------------------------------------------- loss
def test_integer_label_loss_equals_tunix_default_loss(tiny_model_dir, token_rows):
    from tunix.sft import utils as sft_utils
    from tunix.sft.peft_trainer import _default_loss_fn

    model, _ = load_model(tiny_model_dir, None)
    batch = _batch(token_rows)
    ours = completion_loss(model, **batch)
    real = jnp.asarray(token_arrays(token_rows)["segment_ids"][:4] > 0)
    tunix = _default_loss_fn(
        model, batch["input_tokens"], batch["loss_mask"],
        sft_utils.build_positions_from_mask(real), sft_utils.make_causal_attn_mask(real),
    )
    # the same logits (the same forward ops on the same inputs); the two formulas differ by a logsumexp
    # over the vocabulary (V terms) per token and the mean over n tokens: (V + n) * eps relative
    vocab = model.embedder.input_embedding.shape[0]
    np.testing.assert_allclose(ours, tunix, rtol=(vocab + _completion_tokens(batch)) * EPS)
    assert 4.0 < float(ours) < 8.0  # about ln(vocab) for random weights


def test_chunked_loss_and_its_gradient_equal_the_whole(tiny_model_dir, token_rows):
    model, _ = load_model(tiny_model_dir, None)
    batch = _batch(token_rows)

    def loss(m, chunk):
        return completion_loss(m, **batch, chunk_size=chunk)

    whole, g_whole = nnx.value_and_grad(loss)(model, 64)  # 47 positions: one chunk
    chunked, g_chunked = nnx.value_and_grad(loss)(model, 10)  # the last chunk is padded
    # the same per-token terms, summed chunk by chunk: a reordered sum of n tokens
    np.testing.assert_allclose(chunked, whole, rtol=_completion_tokens(batch) * EPS)
    _assert_gradients_close(g_chunked, g_whole, terms=batch["input_tokens"].size)


@pytest.mark.slow
def test_packed_rows_give_the_same_loss_as_unpacked(tiny_model_dir, tokenizer, formatted):
    model, _ = load_model(tiny_model_dir, None)
    plain, _ = tokenize_split(formatted, tokenizer, TokenizeParams(max_length=128))
    packed, stats = tokenize_split(formatted, tokenizer, TokenizeParams(max_length=128, pack=True))
    assert len(packed) < len(plain) / 2

    def nll(rows):
        from tunix_pipeline.train.loss import token_nll

        out = [token_nll(model, **_batch(rows.iloc[i : i + 1], 1)) for i in range(len(rows))]
        return sum(float(s) for s, _ in out), sum(float(c) for _, c in out)

    (s_plain, c_plain), (s_packed, c_packed) = nll(plain), nll(packed)
    assert c_plain == c_packed
    # other rows and shapes: the logits themselves round differently
    np.testing.assert_allclose(s_packed / c_packed, s_plain / c_plain, rtol=0,
                               atol=_mean_nll_atol(tiny_model_dir, model, plain, s_plain / c_plain))


def test_bf16_compute_keeps_fp32_weights(tiny_model_dir, token_rows):
    model, _ = load_model(tiny_model_dir, None)
    batch = _batch(token_rows)
    fp32 = completion_loss(model, **batch)
    bf16, grads = nnx.value_and_grad(lambda m: completion_loss(m, **batch, compute_dtype=jnp.bfloat16))(model)
    # bfloat16 keeps 8 significant bits (eps 2**-7): a sanity bound on the loss, not a rounding bound
    assert abs(float(bf16) - float(fp32)) < 0.05 * float(fp32)
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}


@pytest.mark.parametrize("remat", ["attention", "decoder"])
def test_remat_changes_memory_not_results(tiny_model_dir, token_rows, remat):
    batch = _batch(token_rows)

    def grads(model):
        return nnx.value_and_grad(lambda m: completion_loss(m, **batch))(model)

    (plain, g_plain), (rematted, g_remat) = grads(load_model(tiny_model_dir, None)[0]), grads(
        load_model(tiny_model_dir, None, remat=remat)[0]
    )
    # remat recomputes the same forward ops; XLA may fuse the recomputation differently
    np.testing.assert_allclose(rematted, plain, rtol=_completion_tokens(batch) * EPS)
    _assert_gradients_close(g_remat, g_plain, terms=batch["input_tokens"].size)


def test_weight_decay_skips_norms(tmp_path):
    params = {"kernel": jnp.ones((4, 4)), "scale": jnp.ones((4,))}
    sft = _sft(tmp_path, weight_decay=0.5, warmup_steps=0, schedule="constant", max_grad_norm=None)
    tx = make_optimizer(sft, sft.max_steps)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    assert float(jnp.abs(updates["kernel"]).max()) > 0 and float(jnp.abs(updates["scale"]).max()) == 0


def test_mu_dtype_keeps_adams_first_moment_in_bf16_and_its_second_in_the_weights_dtype(tmp_path):
    from pydantic import ValidationError

    params = {"kernel": jnp.ones((4, 4), jnp.float32)}
    sft = _sft(tmp_path, mu_dtype="bfloat16")
    state = make_optimizer(sft, sft.max_steps).init(params)
    moments = {str(leaf.dtype) for leaf in jax.tree.leaves(state) if getattr(leaf, "shape", ()) == (4, 4)}
    assert moments == {"bfloat16", "float32"}  # mu, nu
    with pytest.raises(ValidationError, match="mu_dtype is AdamW's first moment"):
        _sft(tmp_path, mu_dtype="bfloat16", optimizer="adafactor")


def test_float32_weights_restore_into_a_bf16_model(tiny_model_dir, tmp_path):
    """A session that loads the model in bf16 (tpu_full's GRPO) starts from its parent's float32 checkpoint: Orbax
    casts to the model's dtype on restore."""
    from tunix.sft.checkpoint_manager import CheckpointManager

    masters, _ = load_model(tiny_model_dir, None, dtype="float32")
    nnx.update(masters, jax.tree.map(lambda w: w + 1e-3, nnx.state(masters)))
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(1, masters, force=True)
    manager.close()
    model, _ = load_model(tiny_model_dir, None, dtype="bfloat16")
    assert restore_latest(model, tmp_path / "ckpt") == 1
    for restored, saved in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(masters))):
        assert restored.dtype == jnp.bfloat16
        np.testing.assert_array_equal(restored, saved.astype(jnp.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("lora, remat", [(True, "none"), (False, "decoder")])
def test_logged_mfu_is_the_plans_mfu_without_a_hand_set_peak(tiny_model_dir, token_rows, tmp_path, lora, remat):
    """`train/mfu` = the plan's FLOPs of a step (LoRA: 2 passes, remat: one more) / step time / the profile's peak;
    `train/useful_mfu` and `train/useful_tokens_per_sec` count only the step's non-padding tokens."""
    import yaml

    from tunix_pipeline.config import LoraParams, ModelParams, PlanParams
    from tunix_pipeline.models import load_run_model
    from tunix_pipeline.planning import peak_flops_per_device
    from tunix_pipeline.models.architecture import resolve
    from tunix_pipeline.planning.job import make_job

    plan = PlanParams(**yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"])
    peak = peak_flops_per_device(plan, MESH)  # runtime.peak_flops_per_device unset: the cpu profile's
    assert peak == plan.profiles["cpu"].peak_tflops * 1e12
    model_params = ModelParams(source=str(tiny_model_dir), lora=LoraParams(rank=4, alpha=8.0) if lora else None)
    sft = _sft(tmp_path, max_steps=3, remat=remat)
    mesh = make_mesh(MESH)
    model, _ = load_run_model(tiny_model_dir, model_params, mesh, remat=remat)
    logged: dict[str, dict[int, float]] = {}

    def listen(name, value, step=None, **_):
        logged.setdefault(name.rsplit("/", 1)[-1], {})[step] = float(value)

    jax.monitoring.register_scalar_listener(listen)
    try:
        result = train(model, token_rows, token_rows.head(0), sft, mesh, metrics_backends=None, peak_flops_per_device=peak)
    finally:
        jax.monitoring.unregister_scalar_listener(listen)
    seq_len = len(token_rows["input_tokens"].iloc[0])
    job = make_job(resolve(model_params), model_params, sft, MESH, seq_len, devices=8)  # from config.json
    assert job.mode == ("lora" if lora else "full") and job.remat == remat
    plan_flops = job.flops_per_step(job.global_batch, job.remat)
    assert logged["mfu"] and set(logged["mfu"]) == set(logged["step_time"])
    for step, mfu in logged["mfu"].items():
        # the same float64 operations in another order: a few roundings apart
        assert mfu == pytest.approx(plan_flops / logged["step_time"][step] / (peak * 8), rel=1e-12)
    # the non-padding tokens of the rows each step was fed, counted from the batches themselves
    batches = BatchFeed(token_rows, job.global_batch, sft.seed)
    useful = {step: int((batches.batch(step - 1)["segment_ids"] > 0).sum()) for step in range(1, 4)}
    slots = job.global_batch * seq_len
    assert 0 < min(useful.values()) and max(useful.values()) < slots  # these rows are padded
    for step, seconds in logged["step_time"].items():
        assert logged["useful_tokens_per_sec"][step] == pytest.approx(useful[step] / seconds, rel=1e-12)
        assert logged["padding_fraction"][step] == pytest.approx(1 - useful[step] / slots, rel=1e-12)
        assert logged["useful_mfu"][step] == pytest.approx(logged["mfu"][step] * useful[step] / slots, rel=1e-12)
    # the sft result: medians of the logged rates, and the padding share of all three steps
    assert result["median_useful_mfu"] == pytest.approx(float(np.median(list(logged["useful_mfu"].values()))))
    assert result["median_tokens_per_sec"] == pytest.approx(float(np.median(list(logged["tokens_per_sec"].values()))))
    assert result["padding_fraction"] == pytest.approx(1 - sum(useful.values()) / (3 * slots))


@pytest.mark.slow
def test_a_lora_step_trains_its_adapters_and_leaves_the_frozen_weights_where_they_are(
        tiny_model_dir, token_rows, tmp_path, monkeypatch):
    """Tunix's `nnx.jit` step returns every variable of the model it is given: under LoRA each step wrote a new copy
    of every frozen weight (the base model held twice at the step's peak). Ours takes them as an input only: the
    same buffers after training, and the same losses and adapters as Tunix's own step, bitwise."""
    from tunix_pipeline import upstream
    from tunix_pipeline.config import LoraParams, ModelParams
    from tunix_pipeline.models import load_run_model

    model_params = ModelParams(source=str(tiny_model_dir), lora=LoraParams(rank=4, alpha=8.0))
    mesh = make_mesh(MESH)

    def run(name):
        model, _ = load_run_model(tiny_model_dir, model_params, mesh)
        frozen = nnx.state(model, upstream.FROZEN)
        buffers = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(frozen) for s in x.addressable_shards}
        result = train(model, token_rows, token_rows.head(0), _sft(tmp_path / name, max_steps=3), mesh)
        after = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(model, upstream.FROZEN))
                 for s in x.addressable_shards}
        return result["history"], _params(model), buffers == after

    built, jit = [], upstream.frozen_weights_in_only
    monkeypatch.setattr(upstream, "frozen_weights_in_only", lambda *args: built.append(jit(*args)) or built[-1])
    losses, weights, kept = run("ours")
    assert len(built) == 1 and built[0].func.jitted_fn._cache_size() == 1  # compiled once, for every step
    monkeypatch.setattr(upstream, "keep_frozen_weights_in", lambda trainer: None)  # Tunix's own jitted step
    tunix_losses, tunix_weights, tunix_kept = run("tunix")
    assert kept and not tunix_kept
    assert losses == tunix_losses and len(losses) == 3
    assert all(np.array_equal(weights[k], tunix_weights[k]) for k in weights)
    assert any("lora" in k for k in weights)


def test_eval_loss_does_not_depend_on_batch_padding(tiny_model_dir, token_rows):
    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh)
    rows = token_rows.head(20)  # 20 rows: padded batches at sizes 8 and 16
    a = evaluate_loss(model, rows, 8, mesh)
    b = evaluate_loss(model, rows, 16, mesh)
    assert a["tokens"] == b["tokens"] == int(np.stack(rows["loss_mask"]).astype(bool)[:, 1:].sum())
    assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=_mean_nll_atol(tiny_model_dir, model, rows, b["loss"]))


# ---------------------------------------------------------------- training, checkpoints, resume
@pytest.mark.slow
def test_sft_trains_checkpoints_and_resumes_exactly(tiny_model_dir, token_rows, tmp_path, monkeypatch):
    mesh = make_mesh(MESH)
    straight, _ = load_model(tiny_model_dir, mesh)
    train(straight, token_rows, token_rows.head(0), _sft(tmp_path / "a"), mesh)

    # the same run, stopped after step 4 (as preemption or the budget would stop it)
    fetch = BatchFeed.load_next_train_batch

    def stop_at_4(self, trainer):
        if trainer.iter_steps == 4:
            self.stop("test")
        return fetch(self, trainer)

    monkeypatch.setattr(BatchFeed, "load_next_train_batch", stop_at_4)
    model, _ = load_model(tiny_model_dir, mesh)
    first = train(model, token_rows, token_rows.head(4), _sft(tmp_path / "b", eval_every=2), mesh)
    assert (first["latest_step"], first["resumed_from_step"], first["stopped_early"]) == (4, 0, "test")
    assert first["last_loss"] < first["first_loss"]
    assert sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir() if p.name.isdigit()) == ["3", "4"]
    monkeypatch.undo()

    # rerun: resumes from step 4, sees the batches an uninterrupted run sees, ends where it ended
    model, _ = load_model(tiny_model_dir, mesh)
    second = train(model, token_rows, token_rows.head(4), _sft(tmp_path / "b"), mesh)
    assert (second["resumed_from_step"], second["latest_step"], second["steps_this_run"]) == (4, 6, 2)
    assert [h["step"] for h in second["history"]] == list(range(1, 7))
    # the training time is every run's, kept beside the checkpoints
    assert second["train_seconds"] == pytest.approx(first["train_seconds"] + second["seconds_this_run"], abs=0.01)
    # bitwise: the resumed run executes the same compiled step on the same restored state and batches
    expected, got = _params(straight), _params(model)
    assert all(np.array_equal(expected[k], got[k]) for k in expected)

    # a rerun with nothing left to train keeps every figure of the training, its time included
    fresh, _ = load_model(tiny_model_dir, mesh)
    again = train(fresh, token_rows, token_rows.head(4), _sft(tmp_path / "b"), mesh)
    assert (again["latest_step"], again["steps_this_run"], again["history"]) == (6, 0, second["history"])
    assert again["train_seconds"] == pytest.approx(second["train_seconds"] + again["seconds_this_run"], abs=0.01)

    fresh, _ = load_model(tiny_model_dir, mesh)
    assert restore_latest(fresh, tmp_path / "b" / "ckpt") == 6
    assert np.array_equal(_params(fresh)["embedder.input_embedding"], got["embedder.input_embedding"])


@pytest.mark.parametrize("text", ["[{\"step\": 1, \"loss\": 2.0}, {\"st", "{\"step\": 1}", "[1, 2]", "\udcff"])
def test_a_damaged_history_file_is_set_aside_and_the_run_goes_on(tmp_path, caplog, text):
    """A history beside the checkpoints edited or cut short by hand: one warning line, the file kept aside, the
    resume goes on without the values it held (the checkpoints themselves are intact)."""
    from etils import epath

    ckpt = epath.Path(tmp_path)
    for name in (HISTORY_FILE, SECONDS_FILE):
        (tmp_path / name).write_text(text, errors="surrogateescape")
    assert load_history(ckpt, 6) == []
    assert TrainClock(ckpt, 6).before == 0.0
    assert sorted(p.name for p in tmp_path.iterdir()) == [HISTORY_FILE + ".corrupt", SECONDS_FILE + ".corrupt"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all("cannot be read" in w and "\n" not in w for w in warnings), warnings
    # the next save writes a good file again
    TrainClock(ckpt, 6).save(7)
    assert load_history(ckpt, 7, SECONDS_FILE)[0]["step"] == 7


def _adam_state(step_dir):
    """(update count, first moment per parameter) of Adam's state in a saved checkpoint."""
    import orbax.checkpoint as ocp

    def find(node):  # Adam's state sits under optax wrappers (MultiSteps, inject_hyperparams, chain)
        if isinstance(node, dict):
            return node if "mu" in node else next(filter(None, map(find, node.values())), None)

    checkpointer, path = ocp.PyTreeCheckpointer(), step_dir / "optimizer_state"
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), checkpointer.metadata(path).item_metadata.tree)
    adam = find(checkpointer.restore(path, restore_args=as_numpy))  # numpy: also saved by another process's devices
    flat = jax.tree_util.tree_flatten_with_path(adam["mu"])[0]
    return int(adam["count"]["value"]), {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


@pytest.mark.slow
def test_gradient_accumulation_matches_one_larger_batch(tiny_model_dir, tmp_path):
    # Compares the gradient each optimizer step applies, not the weights after AdamW: Adam's first
    # update is about lr * sign(g), so rounding noise in a near-zero gradient moves a weight by up to lr.
    from .test_export import _rows

    # 16 different sequences with the same completion length: the mean of the two micro-batch means
    # is the mean over all 8 rows, so both runs apply the same gradient up to rounding
    rows = pd.concat([_rows(n=1, length=24, seed=i) for i in range(16)], ignore_index=True)
    mesh = make_mesh(MESH)
    one = dict(max_steps=1, warmup_steps=0, max_grad_norm=None, checkpoint_every=1)
    big, _ = load_model(tiny_model_dir, mesh)
    train(big, rows, rows.head(0), _sft(tmp_path / "a", per_device_batch_size=2, **one), mesh)
    small, _ = load_model(tiny_model_dir, mesh)
    result = train(small, rows, rows.head(0),
                   _sft(tmp_path / "b", per_device_batch_size=1, gradient_accumulation_steps=2, **one), mesh)
    assert result["global_batch_size"] == 8 and result["latest_step"] == 1
    (count_a, mu_a), (count_b, mu_b) = _adam_state(tmp_path / "a" / "ckpt" / "1"), _adam_state(tmp_path / "b" / "ckpt" / "1")
    assert count_a == count_b == 1  # two micro-batches made one optimizer update
    # after one step Adam's first moment is 0.1 * g, g summed over 8 rows x 24 positions (measured:
    # within 5 eps x the largest entry); one micro-batch alone, or a sum, would be off by ~|g|
    assert sorted(mu_a) == sorted(mu_b)
    _assert_gradients_close(mu_b, mu_a, terms=8 * 24)


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", ["metadata and data", "one data file"])
def test_corrupt_latest_checkpoint_is_set_aside(tiny_model_dir, token_rows, tmp_path, capfd, caplog, monkeypatch,
                                                corrupt):
    """The recovery is one warning line; no traceback anywhere (logs, stderr, exceptions Python reports unraised,
    such as a callback of the failed restore finding its event loop closed)."""
    import gc

    unraised = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)
    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh)
    train(model, token_rows, token_rows.head(0), _sft(tmp_path, max_steps=6), mesh)
    params = tmp_path / "ckpt" / "6" / "model_params"
    files = [f for f in sorted(params.rglob("*")) if f.is_file() and f.stat().st_size > 100]
    if corrupt == "one data file":  # the restore fails on one array while the others are still being read
        files = [max((f for f in files if f.parent.name == "d"), key=lambda f: f.stat().st_size)]
    for f in files:
        f.write_bytes(b"\0" * 10)  # truncated
    model, _ = load_model(tiny_model_dir, mesh)
    result = train(model, token_rows, token_rows.head(0), _sft(tmp_path, max_steps=6), mesh)
    assert result["resumed_from_step"] == 3 and result["latest_step"] == 6
    assert (tmp_path / "ckpt" / "6.corrupt").is_dir()
    gc.collect()  # what the failed restore left behind is finalized now, not after the test
    time.sleep(1)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tunix_pipeline")]
    assert len(warnings) == 1 and "cannot be restored" in warnings[0].getMessage(), warnings
    assert "\n" not in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and not unraised, (err[-3000:], [u.exc_value for u in unraised])


def test_a_failed_read_leaves_no_callback_on_a_closed_loop(tmp_path, monkeypatch):
    """What a corrupt checkpoint's restore does inside Orbax: one read of a `gather` fails at once while others are
    in flight. Orbax's own loop (unpatched) closes under them: 4 of 5 tries measured a `RuntimeError: Event loop is
    closed` per late read, reported through `sys.unraisablehook`; with `upstream.loops_finish_their_tasks`, none."""
    import asyncio
    import gc

    import tensorstore as ts
    from orbax.checkpoint._src import asyncio_utils

    from tunix_pipeline.upstream import loops_finish_their_tasks

    def array(name, size, chunk):
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / name)}}
        layout = ts.ChunkLayout(read_chunk_shape=[chunk, chunk])
        store = ts.open(spec, create=True, dtype=ts.float32, shape=[size, size], chunk_layout=layout).result()
        store.write(np.ones((size, size), np.float32)).result()
        return spec

    bad = array("bad", 4, 4)
    (tmp_path / "bad" / "0.0").write_bytes(b"\0" * 10)  # truncated
    slow = [array(f"big{i}", 1024, 64) for i in range(8)]  # 256 chunks each, still being read when `bad` fails

    async def read(spec):
        return await (await ts.open(spec)).read()

    async def restore():
        return await asyncio.gather(*(read(spec) for spec in [*slow, bad]))

    unraised = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)
    loops_finish_their_tasks()
    for _ in range(3):
        with pytest.raises(ValueError, match="blosc"):
            asyncio_utils.run_sync(restore())
    time.sleep(1)  # a read that outlived its loop would have called back by now
    gc.collect()
    assert not unraised, [str(u.exc_value) for u in unraised]


@pytest.mark.slow  # a trainer run out of its time budget
def test_session_budget_stops_with_a_checkpoint_in_time(tiny_model_dir, token_rows, tmp_path):
    import psutil

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh)

    def budgeted(folder, seconds):  # a long run whose session budget ends `seconds` from now
        elapsed = time.time() - psutil.Process().create_time()
        return _sft(folder, max_steps=100_000, checkpoint_every=1000, time_budget_hours=(elapsed + seconds) / 3600)

    # the same run stopped once before, so that its programs are compiled (read back from the compilation cache
    # below), as in a long session: cold, on a loaded 2-core machine, their compile alone took longer than 15 s
    train(model, token_rows, token_rows.head(0), budgeted(tmp_path / "warm", 5.0), mesh)
    deadline_in = 15.0
    sft = budgeted(tmp_path, deadline_in)
    started = time.time()
    result = train(model, token_rows, token_rows.head(0), sft, mesh)
    assert time.time() - started < deadline_in
    assert result["stopped_early"] == "session time budget" and 0 < result["latest_step"] < 100_000
    assert (tmp_path / "ckpt" / str(result["latest_step"])).is_dir()


def _run_worker(spec, **popen):
    return subprocess.Popen([sys.executable, WORKER, json.dumps(spec)], cwd=ROOT, **popen)


def _spec(tiny_model_dir, rows_file, out, ckpt, **sft):
    return {
        "model_dir": str(tiny_model_dir), "rows": str(rows_file), "out": str(out), "mesh": {"fsdp": 4, "tp": 2},
        "sft": {"max_steps": 10, "per_device_batch_size": 1, "learning_rate": 1e-2, "warmup_steps": 1,
                "checkpoint_every": 2, "checkpoint_dir": str(ckpt), **sft},
    }


def _wait_for(path, process, seconds=120):
    deadline = time.time() + seconds
    while not path.exists():
        assert process.poll() is None, "the worker ended before the test could interrupt it"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_then_rerun_ends_bitwise_equal_to_an_uninterrupted_run(tiny_model_dir, rows_file, tmp_path):
    straight = _run_worker(_spec(tiny_model_dir, rows_file, tmp_path / "straight", tmp_path / "a"))
    assert straight.wait(300) == 0

    spec = {**_spec(tiny_model_dir, rows_file, tmp_path / "resumed", tmp_path / "b"), "seconds_per_step": 0.3}
    victim = _run_worker(spec)
    _wait_for(tmp_path / "b" / "4", victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    assert not (tmp_path / "resumed.json").exists()
    spec.pop("seconds_per_step")
    assert _run_worker(spec).wait(300) == 0

    result = json.loads((tmp_path / "resumed.json").read_text())
    assert result["resumed_from_step"] >= 4 and result["latest_step"] == 10
    assert [h["step"] for h in result["history"]] == list(range(1, 11))
    a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


@pytest.mark.slow  # a training process of its own
def test_progress_lines_in_a_log_without_a_terminal(tiny_model_dir, rows_file, tmp_path):
    """Piped output (no TTY, no notebook): no bar, but lines with step, loss, useful tokens/s of the padded rate,
    the padding share and time left."""
    spec = {**_spec(tiny_model_dir, rows_file, tmp_path / "out", tmp_path / "ckpt"), "log_info": True}
    worker = _run_worker(spec, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0, output
    steps = re.findall(r"sft: step (\d+)/10 \(\d+%\), loss \d+\.\d{4}"
                       r"(, [\d,]+ useful tokens/s of [\d,]+ \(\d+% padding\), \d+:\d\d:\d\d left)?", output)
    numbers = [int(step) for step, _ in steps]
    assert numbers[0] == 1 and numbers[-1] == 10 and numbers == sorted(set(numbers)), output  # first, last, in order
    assert all(timed for _, timed in steps[1:])  # from the second step on: throughput and time left
    assert "it/s" not in output and "step/s" not in output  # no tqdm bar written into the log


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tiny_model_dir, rows_file, tmp_path):
    spec = {**_spec(tiny_model_dir, rows_file, tmp_path / "out", tmp_path / "ckpt", max_steps=1000,
                    checkpoint_every=500), "seconds_per_step": 0.3}
    worker = _run_worker(spec, stdout=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "out.training", worker)
    time.sleep(3)
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=120)
    assert worker.returncode == 3, out
    assert "rerun the same command to resume" in out
    steps = [int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()]
    assert steps and 0 < max(steps) < 1000


@pytest.mark.slow
def test_two_processes_give_the_loss_and_gradient_of_one(tiny_model_dir, rows_file, tmp_path):
    # one row per device: 2 rows a process over 4 data-parallel devices, which Tunix's shard_input replicated
    # (each process then computed on its own rows as the whole batch); runtime.shard_rows makes them one batch.
    # One step: its loss and gradient are the same sums in another order; after it AdamW would turn
    # rounding noise in near-zero gradients into lr-sized weight differences.
    one_row = {"max_steps": 1, "per_device_batch_size": 1, "warmup_steps": 0, "max_grad_norm": None,
                "checkpoint_every": 1}
    single = _run_worker(_spec(tiny_model_dir, rows_file, tmp_path / "single", tmp_path / "a", **one_row))
    assert single.wait(300) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [
        _run_worker({**_spec(tiny_model_dir, rows_file, tmp_path / "multi", tmp_path / "b", **one_row),
                     "devices": 4, "num_processes": 2, "process_id": i, "coordinator": f"127.0.0.1:{port}"})
        for i in range(2)
    ]
    assert [w.wait(300) for w in workers] == [0, 0]
    one = json.loads((tmp_path / "single.json").read_text())["history"]
    two = json.loads((tmp_path / "multi.json").read_text())["history"]
    assert [h["step"] for h in two] == [1]
    terms = 4 * 48  # the step's rows x positions
    np.testing.assert_allclose(two[0]["loss"], one[0]["loss"], rtol=terms * EPS)
    (count_one, mu_one), (count_two, mu_two) = _adam_state(tmp_path / "a" / "1"), _adam_state(tmp_path / "b" / "1")
    assert count_one == count_two == 1 and sorted(mu_one) == sorted(mu_two)
    _assert_gradients_close(mu_two, mu_one, terms)


def test_warmup_must_fit_in_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"warmup_steps \(6\) must be smaller than max_steps \(6\)"):
        _sft(tmp_path, warmup_steps=6)


# ---------------------------------------------------------------- the dev split's score: keep the best step
@pytest.mark.slow
def test_the_sft_node_scores_the_dev_split_of_a_run_by_epochs(tiny_model_dir, token_rows, formatted, tmp_path):
    """`sft.epochs` (max_steps unset) trains, and with `sft.dev_eval` the node scores the dev split as it goes; only
    `max_steps: 0` trains nothing."""
    import yaml

    from tunix_pipeline.config import ModelParams, PlanParams, TrackingParams
    from tunix_pipeline.pipelines.sft.nodes import train_sft

    plan = PlanParams(**yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"])
    eval_formatted = formatted.head(3).assign(answer=["1", "2", "3"], split="dev")
    sft = _sft(tmp_path, max_steps=None, epochs=1, checkpoint_every=100,
               dev_eval={"every": 100, "prompts": 2, "max_new_tokens": 4, "batch_size": 2})
    result = train_sft(token_rows, token_rows.head(0), eval_formatted, {"path": str(tiny_model_dir)}, ModelParams(),
                       sft, MESH, TrackingParams(log_outputs=[]), plan)
    assert result["steps_this_run"] == result["latest_step"] > 0
    assert [p["step"] for p in result["dev_curve"]] == [result["latest_step"]]  # scored at the last step


@pytest.mark.slow
def test_dev_eval_keeps_and_hands_on_the_best_step(tiny_model_dir, token_rows, formatted, tmp_path, monkeypatch):
    from tunix_pipeline.config import ExportParams, FormatParams, ModelParams
    from tunix_pipeline.evaluate import evaluation
    from tunix_pipeline.evaluate.dev_eval import CURVE_FILE, DevEval
    from tunix_pipeline.models import load_tokenizer
    from tunix_pipeline.pipelines.export import nodes as export_nodes
    from tunix_pipeline.train.checkpoints import restore_required, start_from

    mesh = make_mesh(MESH)
    tokenizer = load_tokenizer(tiny_model_dir)
    # 3 dev rows after 2 rows of an evaluation-only test source, which are never scored during training
    eval_formatted = formatted.head(5).assign(answer=[str(i + 1) for i in range(5)],
                                              split=["test", "test", "dev", None, "dev"])
    # the tiny random model answers nothing right: the lenient accuracy each dev step reports is scripted (steps
    # 2, 4, 6; the run stops after 4 and resumes), the rest is the real score of the real generations
    scripted, scored, at_step = [0.25, 0.75, 0.5], [], {}
    real_score = evaluation.score

    def score(label, rows, texts, params, lengths=None, judged=None):
        metrics, samples = real_score(label, rows, texts, params, lengths, judged)
        scored.append(list(rows["id"]))
        at_step[len(scored)] = _params(model)  # the weights it scored
        return {**metrics, "lenient_accuracy": scripted[len(scored) - 1]}, samples

    monkeypatch.setattr(evaluation, "score", score)
    fetch = BatchFeed.load_next_train_batch

    def stop_at_4(self, trainer):
        if trainer.iter_steps == 4:
            self.stop("test")
        return fetch(self, trainer)

    dev = {"every": 2, "prompts": 3, "max_new_tokens": 4, "batch_size": 4}
    params = _sft(tmp_path, checkpoint_every=3, keep_checkpoints=1, dev_eval=dev)
    with monkeypatch.context() as stopped:
        stopped.setattr(BatchFeed, "load_next_train_batch", stop_at_4)
        model, _ = load_model(tiny_model_dir, mesh)
        first = train(model, token_rows, token_rows.head(0), params, mesh,
                      dev=DevEval(params.dev_eval, tokenizer, eval_formatted, "sft"))
    assert first["latest_step"] == 4 and [p["step"] for p in first["dev_curve"]] == [2, 4]
    model, _ = load_model(tiny_model_dir, mesh)
    logged = {}  # what the metrics backends (MLflow) receive

    def listen(name, value, step=None, **_):
        if name.startswith("/dev/"):
            logged[(name.strip("/"), step)] = float(value)

    jax.monitoring.register_scalar_listener(listen)
    try:
        result = train(model, token_rows, token_rows.head(0), params, mesh,
                       dev=DevEval(params.dev_eval, tokenizer, eval_formatted, "sft"))
    finally:
        jax.monitoring.unregister_scalar_listener(listen)
    assert logged[("dev/lenient_accuracy", 6)] == 0.5 and ("dev/format_compliance", 6) in logged

    assert scored == [["2", "3", "4"]] * 3  # the dev rows only, the first `prompts` of them
    curve = result["dev_curve"]
    assert [(p["step"], p["examples"], p["lenient_accuracy"]) for p in curve] == [
        (2, 8, 0.25), (4, 16, 0.75), (6, 24, 0.5)]
    assert all(p["format_compliance"] is not None and p["answer_accuracy"] is not None for p in curve)
    assert (result["best_step"], result["selected_step"], result["latest_step"]) == (4, 4, 6)
    assert json.loads((tmp_path / "ckpt" / CURVE_FILE).read_text()) == curve  # a resumed run continues it
    # keep_checkpoints: 1 keeps the latest, and the best step besides
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["4", "6"]

    # what evaluate and the polish stages restore, and what export ships: step 4's weights
    fresh, _ = load_model(tiny_model_dir, mesh)
    assert restore_required(fresh, tmp_path / "ckpt", "sft", "evaluate", 4) == 4
    best = at_step[2]
    assert all(np.array_equal(best[k], v) for k, v in _params(fresh).items())
    shipped = {}
    monkeypatch.setattr(export_nodes, "export_pretrained", lambda network, *a, **k: shipped.update(_params(network)))
    exported = export_nodes.export_model({"path": str(tiny_model_dir)}, ModelParams(), ExportParams(
        output_dir=str(tmp_path / "out")), MESH, FormatParams(), sft_result=result)
    assert exported["checkpoint_step"] == 4
    assert all(np.array_equal(best[k], v) for k, v in shipped.items()) and shipped
    # a later session's `sft.init_from` this folder starts from the best step too
    fresh, _ = load_model(tiny_model_dir, mesh)
    lineage = start_from(fresh, tmp_path / "ckpt", tmp_path / "next")
    assert (lineage["parent_step"], lineage["parent_best_step"]) == (4, 4)
    assert all(np.array_equal(best[k], v) for k, v in _params(fresh).items())
    # and a session that trains nothing (`sft.max_steps: 0`) hands that step on as its own, no Kedro needed
    passing = _sft(tmp_path, max_steps=0, init_from=str(tmp_path / "ckpt"), checkpoint_dir=str(tmp_path / "idle"))
    fresh, _ = load_model(tiny_model_dir, mesh)
    passed = train(fresh, token_rows, token_rows.head(0), passing, mesh)
    assert [passed[k] for k in ("latest_step", "best_step", "selected_step", "steps_this_run")] == [4, 4, 4, 0]
    assert Path(passed["checkpoint_dir"]) == (tmp_path / "ckpt").resolve() and not (tmp_path / "idle").exists()
    assert all(np.array_equal(best[k], v) for k, v in _params(fresh).items())
