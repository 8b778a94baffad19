"""Preference polish after SFT: DPO, ORPO and SimPO on Tunix's `DPOTrainer`.

What we add around the trainer, through its own seams:
- the three losses as their papers define them (`pair_losses`), through the trainer's
  loss hook: DPO on summed sequence log-probabilities, ORPO and SimPO on
  length-averaged ones (Tunix's own ORPO sums them; docs/upstream_tunix.md);
  label smoothing for all three and an optional SFT term on the chosen answer (RPO);
- pairs tokenized ahead of training into the fixed shapes the trainer takes (`pairs`);
  a pair that does not fit is dropped and counted, never truncated into another
  preference (Tunix's string path truncates silently);
- a reference model for DPO only, or its log-probabilities computed once before
  training (`precompute_reference`), so the reference need not be held;
- SFT's machinery for the rest: batches that are a function of the step (`BatchFeed`),
  resume, stop signals and the session budget, MLflow under the `preference/` prefix.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from flax import nnx
from jax.experimental import multihost_utils
from tunix.rl import common
from tunix.sft.dpo import dpo_trainer

from tunix_pipeline import upstream
from tunix_pipeline.config import PreferenceParams
from tunix_pipeline.core import runtime
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.progress import throughput_hooks
from tunix_pipeline.core.runtime import data_parallel_size, process_rows, shard_rows
from tunix_pipeline.models.architecture import model_flops_per_token
from tunix_pipeline.stages import StageResult
from tunix_pipeline.train import checkpoints, loop
from tunix_pipeline.train.loss import target_logps
from tunix_pipeline.train.pairs import PAIR_TOKEN_COLUMNS, pair_arrays
from tunix_pipeline.train.skips import NothingToLearn
from tunix_pipeline.upstream import REFERENCE_COLUMNS

log = logging.getLogger(__name__)
METRICS_PREFIX = "preference"
AUX_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "log_probs/chosen",
               "log_probs/rejected")


# ---------------------------------------------------------------- losses
def _smoothed(z, label_smoothing: float):
    """-log sigmoid(z), with the label flipped with probability `label_smoothing`."""
    return -(jax.nn.log_sigmoid(z) * (1 - label_smoothing) + jax.nn.log_sigmoid(-z) * label_smoothing)


def pair_losses(
    method: str,
    chosen_logps,
    rejected_logps,
    chosen_lengths,
    rejected_lengths,
    ref_chosen_logps=None,
    ref_rejected_logps=None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    orpo_lambda: float = 0.1,
    simpo_gamma: float = 0.5,
    sft_weight: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss per pair, chosen reward, rejected reward) from summed answer log-probabilities and lengths.

    - dpo (Rafailov et al. 2023): -log s(beta [(c - c_ref) - (r - r_ref)]), on sums;
    - simpo (Meng et al. 2024): -log s(beta (c/|c| - r/|r|) - gamma), on averages;
    - orpo (Hong et al. 2024): -c/|c| + lambda * -log s(log odds(c/|c|) - log odds(r/|r|)),
      log odds(p) = p - log(1 - e^p), on averages (as TRL computes it).
    Label smoothing mixes in the flipped label; `sft_weight` adds RPO's NLL of the chosen answer.
    """
    chosen_avg = chosen_logps / jnp.maximum(chosen_lengths, 1)
    rejected_avg = rejected_logps / jnp.maximum(rejected_lengths, 1)
    if method == "dpo":
        chosen_ratio, rejected_ratio = chosen_logps, rejected_logps
        if ref_chosen_logps is not None:
            chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        losses = _smoothed(beta * (chosen_ratio - rejected_ratio), label_smoothing)
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    elif method == "simpo":
        losses = _smoothed(beta * (chosen_avg - rejected_avg) - simpo_gamma, label_smoothing)
        chosen_reward, rejected_reward = beta * chosen_avg, beta * rejected_avg
    elif method == "orpo":
        log_odds = (chosen_avg - rejected_avg) - (jnp.log1p(-jnp.exp(chosen_avg)) - jnp.log1p(-jnp.exp(rejected_avg)))
        losses = -chosen_avg + orpo_lambda * _smoothed(log_odds, label_smoothing)
        chosen_reward, rejected_reward = orpo_lambda * chosen_avg, orpo_lambda * rejected_avg
    else:
        raise ValueError(f"unknown preference method {method!r}")
    if sft_weight:
        losses = losses - sft_weight * chosen_avg
    return losses, chosen_reward, rejected_reward


def pair_accuracy(chosen_reward, rejected_reward):
    """Share of pairs whose chosen answer has the higher reward; a tie counts half."""
    return jnp.mean((chosen_reward > rejected_reward) + 0.5 * (chosen_reward == rejected_reward))


def sequence_logps(model, example):
    """(chosen sums, rejected sums, chosen lengths, rejected lengths) of a Tunix `TrainExample`: its answers'
    log-probabilities with the output layer at the answers' positions only (`loss.target_logps`)."""
    answers = example.completion_mask
    prompt = example.input_ids.shape[1] - example.logits_to_keep
    targets = jnp.concatenate([jnp.zeros((answers.shape[0], prompt), answers.dtype), answers], axis=1)
    logps = target_logps(model, example.input_ids, targets, example.positions, example.attention_mask)
    lengths = answers.sum(axis=-1)
    half = lengths.shape[0] // 2
    return logps[:half], logps[half:], lengths[:half], lengths[half:]


def reference_logps(model, example):
    """(chosen sums, rejected sums) of the reference model, for the trainer's reference pass."""
    return sequence_logps(model, example)[:2]


def loss_fn_for(params: PreferenceParams):
    """Tunix's loss hook for `params.method` (a plain closure: nnx.grad resolves its arguments by position)."""
    def loss(model, train_example):
        return loss_fn(model, train_example, params)

    return loss


def loss_fn(model, train_example, params: PreferenceParams):
    """The configured method's mean loss and the metrics `DPOTrainer` logs."""
    chosen, rejected, chosen_len, rejected_len = sequence_logps(model, train_example)
    losses, chosen_reward, rejected_reward = pair_losses(
        params.method, chosen, rejected, chosen_len, rejected_len,
        train_example.ref_chosen_logps, train_example.ref_rejected_logps,
        beta=params.beta, label_smoothing=params.label_smoothing, orpo_lambda=params.orpo_lambda,
        simpo_gamma=params.simpo_gamma, sft_weight=params.sft_weight,
    )
    aux = {
        "rewards/chosen": chosen_reward.mean(),
        "rewards/rejected": rejected_reward.mean(),
        "rewards/margin": (chosen_reward - rejected_reward).mean(),
        "rewards/accuracy": pair_accuracy(chosen_reward, rejected_reward),
        "log_probs/chosen": chosen.mean(),
        "log_probs/rejected": rejected.mean(),
    }
    return losses.mean(), aux


# ---------------------------------------------------------------- log-probabilities outside training
def _example(model, batch: dict):
    """A Tunix `TrainExample` of chosen then rejected rows, as `DPOTrainer._prepare_inputs` builds it."""
    prompt = jnp.concatenate([batch["prompt_ids"]] * 2)
    prompt_mask = jnp.concatenate([batch["prompt_mask"]] * 2)
    answers = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]])
    answer_mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    ids, mask = jnp.concatenate([prompt, answers], axis=1), jnp.concatenate([prompt_mask, answer_mask], axis=1)
    if hasattr(model, "get_attention_mask"):  # Gemma 3: its sliding-window mask, as Tunix does
        attention = model.get_attention_mask(ids, inputs_mask=mask)
    else:
        attention = common.make_causal_attn_mask(mask)
    return dpo_trainer.TrainExample(
        input_ids=ids, positions=common.build_positions_from_mask(mask), attention_mask=attention,
        ref_chosen_logps=None, ref_rejected_logps=None, completion_mask=answer_mask, logits_to_keep=answers.shape[1],
    )


def pair_logps(model, rows: pd.DataFrame, batch_size: int, mesh) -> dict[str, np.ndarray]:
    """Summed answer log-probabilities and answer lengths of every pair (the last batch padded and cut off)."""
    arrays = {c: a for c, a in pair_arrays(rows).items() if c in PAIR_TOKEN_COLUMNS}
    local = process_rows(mesh, batch_size)  # each process feeds its share of every batch, as in training
    out = {k: [] for k in ("chosen", "rejected", "chosen_len", "rejected_len")}
    with mesh:
        for start in range(0, len(rows), batch_size):
            batch = {k: v[start : start + batch_size] for k, v in arrays.items()}
            real = len(batch["prompt_ids"])
            batch = {k: np.concatenate([v, np.repeat(v[-1:], batch_size - real, 0)])[local] for k, v in batch.items()}
            example = _example(model, shard_rows(batch, mesh))
            values = _sequence_logps_jit(model, example)
            if jax.process_count() > 1:  # every process gets every pair's values
                values = multihost_utils.process_allgather(values, tiled=True)
            for key, value in zip(out, values):
                out[key].append(np.asarray(jax.device_get(value), np.float64)[:real])
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}


_sequence_logps_jit = nnx.jit(sequence_logps)


def heldout_accuracy(model, rows: pd.DataFrame, params: PreferenceParams, batch_size: int, mesh,
                     reference: dict[str, np.ndarray] | None) -> float | None:
    """Pair accuracy (ties half) of the method's implicit reward on held-out pairs; DPO's needs `reference`."""
    if not len(rows):
        return None
    lp = pair_logps(model, rows, batch_size, mesh)
    _, chosen, rejected = pair_losses(
        params.method, lp["chosen"], lp["rejected"], lp["chosen_len"], lp["rejected_len"],
        reference["chosen"] if reference else None, reference["rejected"] if reference else None,
        beta=params.beta, orpo_lambda=params.orpo_lambda, simpo_gamma=params.simpo_gamma,
    )
    return float(pair_accuracy(np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)))


# ---------------------------------------------------------------- the run
def check_enough_pairs(pairs: int, params: PreferenceParams, mesh, why: tuple[str, str] | None = None) -> int:
    """The global batch (pairs per step); `NothingToLearn` (why, and what to change) when the training pairs
    cannot fill one."""
    batch_size = params.per_device_batch_size * data_parallel_size(mesh)
    if pairs < batch_size:
        cause, fix = why or ("", "build more pairs, or lower preference.per_device_batch_size")
        raise NothingToLearn(
            "preference",
            f"{pairs} training pairs cannot fill one batch of {batch_size} pairs (preference.per_device_batch_size "
            f"x {data_parallel_size(mesh)} data-parallel devices)" + (f": {cause}" if cause else ""),
            fix,
        )
    return batch_size


def train_preference(
    model,
    train_pairs: pd.DataFrame,
    eval_pairs: pd.DataFrame,
    params: PreferenceParams,
    mesh: jax.sharding.Mesh,
    batch_size: int,
    metrics_backends: list | None = None,
    peak_flops_per_device: float | None = None,
) -> StageResult:
    """Preference training of `model` (the SFT policy) in place, `batch_size` pairs a step (`check_enough_pairs`, run
    before the model loads); resumes from `params.checkpoint_dir`.

    Before Tunix restores a checkpoint the model is the SFT policy: the reference
    (a frozen copy, or its log-probabilities) and the step-0 held-out accuracy come from it.
    """
    ckpt_dir = storage_path(params.checkpoint_dir)
    dpo = params.method == "dpo"
    eval_reference = pair_logps(model, eval_pairs, batch_size, mesh) if dpo and len(eval_pairs) else None
    accuracy_before = heldout_accuracy(model, eval_pairs, params, batch_size, mesh, eval_reference)
    arrays = pair_arrays(train_pairs)
    reference = None
    if dpo and params.precompute_reference:  # one pass now instead of a reference model during training
        lp = pair_logps(model, train_pairs, batch_size, mesh)
        arrays.update(zip(REFERENCE_COLUMNS, (lp["chosen"].astype(np.float32), lp["rejected"].astype(np.float32))))
    elif dpo:
        reference = loop.frozen_copy(model)
    feed = loop.BatchFeed(train_pairs, batch_size, params.seed, runtime.process_rows(mesh, batch_size),
                              arrays=arrays, row_tokens=pair_token_counts(arrays)).with_budget(params.time_budget_hours, model)
    seq_len = params.max_prompt_length + params.max_response_length  # a pair's two sequences: its prompt and an answer
    throughput = throughput_hooks(feed.step_tokens, model_flops_per_token(model, seq_len), peak_flops_per_device,
                                  mesh.devices.size)
    with upstream.scalar_listeners_scope(), mesh:
        trainer = _trainer(model, reference, params, ckpt_dir, checkpoints.logger_options(ckpt_dir, metrics_backends),
                           mesh)
        trainer.with_loss_fn(loss_fn_for(params), has_aux=True)
        trainer.with_gen_model_input_fn(lambda example: {"train_example": example})
        upstream.log_aux_metrics(trainer, AUX_METRICS)
        trainer.with_training_hooks(throughput)
        trainer.with_data_hooks(feed)
        run = loop.fit(trainer, feed, ckpt_dir, params.method, params.max_steps)
        curves = {name: checkpoints.metric_history(trainer.metrics_logger, METRICS_PREFIX, name) for name in AUX_METRICS}

    history = run.pop("history") + _with_curves(checkpoints.new_losses(trainer, run["resumed_from_step"]), curves)
    checkpoints.save_history(ckpt_dir, history)
    loop.end_run(feed, "preference", run, params.max_steps, params.time_budget_hours)  # a stop signal: no scoring
    accuracy_after = heldout_accuracy(model, eval_pairs, params, batch_size, mesh, eval_reference)
    return {
        "enabled": True,
        "method": params.method,
        "title": params.method.upper(),
        **run,
        "reference_model": reference is not None,
        "precomputed_reference": dpo and params.precompute_reference,
        "global_batch_size": batch_size,
        "train_pairs": len(train_pairs),
        "eval_pairs": len(eval_pairs),
        "heldout_pair_accuracy_before": accuracy_before,
        "heldout_pair_accuracy": accuracy_after,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "history": history,
    }


def pair_token_counts(arrays: dict) -> tuple[int, np.ndarray]:
    """(token slots of a pair, its non-padding tokens): a pair is two sequences, its prompt before each answer."""
    slots = 2 * (arrays["prompt_ids"].shape[1] + arrays["chosen_ids"].shape[1])
    answers = arrays["chosen_mask"].sum(axis=1) + arrays["rejected_mask"].sum(axis=1)
    return slots, 2 * arrays["prompt_mask"].sum(axis=1) + answers


def _trainer(model, reference, params: PreferenceParams, ckpt_dir, logging_options, mesh):
    """Tunix's DPOTrainer (`upstream.preference_trainer_class`), set up as SFT's trainer is."""
    config = dpo_trainer.DPOTrainingConfig(
        **loop.trainer_config(params, params.max_steps, ckpt_dir, params.method),
        algorithm="orpo" if params.method == "orpo" else "dpo",  # only the metric names differ: our loss hook decides
        beta=params.beta, lambda_orpo=params.orpo_lambda, label_smoothing=params.label_smoothing,
        metrics_logging_options=logging_options,
        metrics_prefix=METRICS_PREFIX,
    )
    return loop.restored_trainer(
        lambda optimizer: upstream.preference_trainer_class(reference_logps)(model, reference, optimizer, config), params,
        params.max_steps, ckpt_dir, mesh,
    )


def _with_curves(losses: list[dict], curves: dict[str, np.ndarray]) -> list[dict]:
    """Each step's loss with the rewards, margin and accuracy logged for it (Tunix writes them a step late)."""
    for i, entry in enumerate(losses):
        for name, values in curves.items():
            entry[name] = float(values[i]) if i < len(values) else None
    return losses
