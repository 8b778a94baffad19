"""Preference polish after SFT: DPO, ORPO and SimPO on Tunix's `DPOTrainer`.

What we add around the trainer, through its own seams:
- the three losses as their papers define them (`pair_losses`), through the trainer's
  loss hook: DPO on summed sequence log-probabilities, ORPO and SimPO on
  length-averaged ones (Tunix's own ORPO sums them; docs/upstream_tunix.md);
  label smoothing for all three and an optional SFT term on the chosen answer (RPO);
- pairs tokenized ahead of training into the fixed shapes the trainer takes (prompt
  left-padded, answers right-padded); a pair that does not fit is dropped and counted,
  never truncated into another preference (Tunix's string path truncates silently);
- a reference model for DPO only, or its log-probabilities computed once before
  training (`precompute_reference`), so the reference need not be held;
- SFT's machinery for the rest: batches that are a function of the step (`BatchFeed`),
  resume, SIGTERM and the session budget, MLflow under the `preference/` prefix.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from flax import nnx

from tunix_pipeline import checkpoints, runtime
from tunix_pipeline.config import PreferenceParams
from tunix_pipeline.errors import UserError
from tunix_pipeline.optim import make_optimizer

log = logging.getLogger(__name__)
METRICS_PREFIX = "preference"
HISTORY_FILE = "preference_history.json"
PAIR_TOKEN_COLUMNS = ["prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"]
REFERENCE_COLUMNS = ["ref_chosen_logps", "ref_rejected_logps"]


class PreferenceError(UserError, ValueError):
    """A preference set-up that cannot run (no pairs fit, no pairs separate, ...)."""


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
    """(chosen sums, rejected sums, chosen lengths, rejected lengths) of a Tunix `TrainExample`."""
    from tunix.sft.dpo import dpo_trainer

    chosen, rejected = dpo_trainer.compute_logps(
        model, example.input_ids, example.positions, example.attention_mask, example.logits_to_keep,
        example.completion_mask,
    )
    lengths = example.completion_mask.sum(axis=-1)
    half = lengths.shape[0] // 2
    return chosen, rejected, lengths[:half], lengths[half:]


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


# ---------------------------------------------------------------- pairs -> fixed-shape token rows
def tokenize_pairs(formatted: pd.DataFrame, tokenizer, params: PreferenceParams) -> tuple[pd.DataFrame, dict]:
    """Formatted pairs (prompt, completion = chosen, rejected) -> DPOTrainer's fixed-shape inputs, and counts.

    Prompts are left-padded to `max_prompt_length`, answers right-padded to `max_response_length`;
    the texts are encoded as SFT encodes them (the rendered prompt already holds the BOS, an answer
    gets none). A pair whose prompt or either answer does not fit is dropped and counted, as is a
    pair whose answers are the same tokens.
    """
    from tunix_pipeline.tokenization import encode_batch

    if tokenizer.pad_token_id is None:
        from tunix_pipeline.models.errors import ModelError

        raise ModelError("the tokenizer has no pad token; add one to the model folder's tokenizer_config.json")
    n, pad = len(formatted), tokenizer.pad_token_id
    p_len, r_len = params.max_prompt_length, params.max_response_length
    texts = formatted["prompt"].tolist() + formatted["completion"].tolist() + formatted["rejected"].tolist()
    encoded = encode_batch(tokenizer, texts) if n else []
    prompts, chosen, rejected = encoded[:n], encoded[n : 2 * n], encoded[2 * n :]
    dropped = {"prompt_too_long": 0, "response_too_long": 0, "same_tokens": 0}
    keep = []
    for i in range(n):
        if len(prompts[i]) > p_len:
            dropped["prompt_too_long"] += 1
        elif max(len(chosen[i]), len(rejected[i])) > r_len:
            dropped["response_too_long"] += 1
        elif chosen[i] == rejected[i]:
            dropped["same_tokens"] += 1
        else:
            keep.append(i)
    arrays = {c: np.full((len(keep), p_len if c.startswith("prompt") else r_len), 0, np.int32) for c in PAIR_TOKEN_COLUMNS}
    for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
        arrays[name][:] = pad
    for row, i in enumerate(keep):
        p = prompts[i]
        arrays["prompt_ids"][row, p_len - len(p):] = p
        arrays["prompt_mask"][row, p_len - len(p):] = 1
        for side, tokens in (("chosen", chosen[i]), ("rejected", rejected[i])):
            arrays[f"{side}_ids"][row, : len(tokens)] = tokens
            arrays[f"{side}_mask"][row, : len(tokens)] = 1
    frame = pd.DataFrame({"id": formatted["id"].astype(str).to_numpy()[keep] if n else [],
                          **{c: list(a) for c, a in arrays.items()}})
    stats = {
        "pairs_in": n,
        "pairs_out": len(keep),
        "dropped": dropped,
        "max_prompt_length": p_len,
        "max_response_length": r_len,
        "max_seen_prompt": max((len(p) for p in prompts), default=0),
        "max_seen_response": max((len(t) for t in chosen + rejected), default=0),
    }
    if sum(dropped.values()):
        log.warning("preference: dropped %s of %d pairs (never truncated); raise preference.max_prompt_length / "
                    "max_response_length to keep them", dropped, n)
    return frame, stats


def pair_arrays(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    """The pair columns as 2-D int arrays (float for precomputed reference log-probs)."""
    from tunix_pipeline.tokenization import stack

    out = {c: stack(rows, c) for c in PAIR_TOKEN_COLUMNS}
    for c in REFERENCE_COLUMNS:
        if c in rows:
            out[c] = rows[c].to_numpy(np.float32)
    return out


# ---------------------------------------------------------------- log-probabilities outside training
def _example(model, batch: dict):
    """A Tunix `TrainExample` of chosen then rejected rows, as `DPOTrainer._prepare_inputs` builds it."""
    from tunix.rl import common
    from tunix.sft.dpo import dpo_trainer

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
    from jax.experimental import multihost_utils

    from tunix_pipeline.runtime import process_rows, shard_rows

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
def check_enough_pairs(pairs: int, params: PreferenceParams, mesh, dropped: dict | None = None) -> int:
    """The global batch (pairs per step); a `PreferenceError` when the training pairs cannot fill one."""
    from tunix_pipeline.runtime import data_parallel_size

    batch_size = params.per_device_batch_size * data_parallel_size(mesh)
    if pairs < batch_size:
        raise PreferenceError(
            f"{pairs} training pairs cannot fill one batch of {batch_size} pairs (preference.per_device_batch_size "
            f"x {data_parallel_size(mesh)} data-parallel devices)"
            + (f"; tokenizing dropped {dropped}" if dropped and sum(dropped.values()) else "")
            + ": lower preference.per_device_batch_size, raise max_prompt_length / max_response_length, or build "
            "more pairs (from_rewards: more max_prompts, a lower margin)"
        )
    return batch_size


@functools.cache
def _trainer_class():
    from tunix.sft.dpo import dpo_trainer

    from tunix_pipeline.training import trainer_class

    class PreferenceTrainer(trainer_class(dpo_trainer.DPOTrainer)):
        """Tunix's DPOTrainer taking precomputed reference log-probabilities from the batch when it has them."""

        def _prepare_inputs(self, batch):
            from tunix_pipeline.runtime import shard_rows

            # each process's rows as one global batch first (the trainer's `data_mesh`): the reference model's
            # pass and the concatenation of chosen and rejected rows then run on the mesh, as on one host
            batch = shard_rows(batch, self.data_mesh)
            reference = [batch.pop(c, None) for c in REFERENCE_COLUMNS]
            example = super()._prepare_inputs(batch)
            if reference[0] is not None:
                example = example.replace(ref_chosen_logps=reference[0], ref_rejected_logps=reference[1])
            return example

    return PreferenceTrainer


def train_preference(
    model,
    train_pairs: pd.DataFrame,
    eval_pairs: pd.DataFrame,
    params: PreferenceParams,
    mesh: jax.sharding.Mesh,
    metrics_backends: list | None = None,
    peak_flops_per_device: float | None = None,
) -> dict:
    """Preference training of `model` (the SFT policy) in place; resumes from `params.checkpoint_dir`.

    Before Tunix restores a checkpoint the model is the SFT policy: the reference
    (a frozen copy, or its log-probabilities) and the step-0 held-out accuracy come from it.
    """
    from tunix.sft.dpo import dpo_trainer

    from tunix_pipeline import training
    from tunix_pipeline.grpo import frozen_copy
    from tunix_pipeline.paths import storage_path
    from tunix_pipeline.tracking import scalar_listeners_scope

    sft = params.as_sft()  # the optimizer, schedule and checkpoint settings, as SFT reads them
    batch_size = check_enough_pairs(len(train_pairs), params, mesh)
    local = runtime.process_rows(mesh, batch_size)
    ckpt_dir = storage_path(params.checkpoint_dir, "preference.checkpoint_dir")
    dpo = params.method == "dpo"
    eval_reference = pair_logps(model, eval_pairs, batch_size, mesh) if dpo and len(eval_pairs) else None
    accuracy_before = heldout_accuracy(model, eval_pairs, params, batch_size, mesh, eval_reference)
    arrays = pair_arrays(train_pairs)
    reference = None
    if dpo and params.precompute_reference:  # one pass now instead of a reference model during training
        lp = pair_logps(model, train_pairs, batch_size, mesh)
        arrays.update(ref_chosen_logps=lp["chosen"].astype(np.float32), ref_rejected_logps=lp["rejected"].astype(np.float32))
    elif dpo:
        reference = frozen_copy(model)
    feed = training.BatchFeed(train_pairs, batch_size, params.seed, local, arrays=arrays)
    if params.time_budget_hours:
        feed.with_deadline(training._process_start() + params.time_budget_hours * 3600,
                           save_seconds=training._save_seconds_guess(model))
    options = checkpoints.logger_options(ckpt_dir, metrics_backends)
    config = dpo_trainer.DPOTrainingConfig(
        algorithm="orpo" if params.method == "orpo" else "dpo",  # only the metric names differ: our loss hook decides
        beta=params.beta, lambda_orpo=params.orpo_lambda, label_smoothing=params.label_smoothing,
        eval_every_n_steps=params.max_steps + 1,
        max_steps=params.max_steps,
        checkpoint_root_directory=str(ckpt_dir),
        checkpointing_options=checkpoints.options(sft.checkpoint_every, sft.keep_checkpoints),
        metrics_logging_options=options,
        data_sharding_axis=runtime.BATCH_AXES,
        metrics_prefix=METRICS_PREFIX,
        pbar_description=params.method,
    )
    seq_len = params.max_prompt_length + params.max_response_length
    tokens = 2 * batch_size * seq_len  # chosen and rejected rows
    flops = tokens * training.train_flops_per_token(model, seq_len)
    with scalar_listeners_scope(), mesh:
        trainer = checkpoints.restored_trainer(
            lambda: _trainer_class()(model, reference, make_optimizer(sft.optim), config), ckpt_dir
        )
        trainer.data_mesh = mesh
        trainer.with_loss_fn(loss_fn_for(params), has_aux=True)
        trainer.with_gen_model_input_fn(lambda example: {"train_example": example})
        trainer._aux_metrics_to_log = {k: np.mean for k in (
            "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "log_probs/chosen",
            "log_probs/rejected")}
        trainer.with_training_hooks(training._throughput_hooks(tokens, flops, peak_flops_per_device, mesh.devices.size))
        trainer.with_data_hooks(feed)
        start_step = trainer.train_steps
        history = checkpoints.load_history(ckpt_dir, start_step)
        checkpoints.record_history_with_checkpoints(trainer, ckpt_dir, history, start_step)
        if start_step:
            log.info("resuming %s from checkpoint step %d in %s", params.method, start_step, ckpt_dir)
        started = time.perf_counter()
        if start_step < params.max_steps:
            with training._stop_on_sigterm(feed):
                trainer.train([], None)  # batches come from the data hook
        else:
            trainer.close()
        seconds = time.perf_counter() - started
        end_step = trainer.train_steps
        curves = {name: checkpoints.metric_history(trainer.metrics_logger, METRICS_PREFIX, name)
                  for name in trainer._aux_metrics_to_log}

    history = history + _with_curves(checkpoints.new_losses(trainer, start_step), curves)
    checkpoints.save_history(ckpt_dir, history)
    accuracy_after = heldout_accuracy(model, eval_pairs, params, batch_size, mesh, eval_reference)
    training._sync("preference_end")
    if feed.stop_reason == "SIGTERM":
        raise training.TrainingInterrupted(
            f"SIGTERM: saved a checkpoint at step {end_step} in {ckpt_dir}; rerun the same command to resume from it"
        )
    if feed.stop_reason:
        log.warning("stopped at step %d of %d to save within the %s h session budget; rerun to continue",
                    end_step, params.max_steps, params.time_budget_hours)
    return {
        "enabled": True,
        "method": params.method,
        "checkpoint_dir": str(ckpt_dir),
        "latest_step": end_step,
        "resumed_from_step": start_step,
        "steps_this_run": end_step - start_step,
        "stopped_early": feed.stop_reason,
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
        "train_seconds": seconds,
    }


def _with_curves(losses: list[dict], curves: dict[str, np.ndarray]) -> list[dict]:
    """Each step's loss with the rewards, margin and accuracy logged for it (Tunix writes them a step late)."""
    for i, entry in enumerate(losses):
        for name, values in curves.items():
            entry[name] = float(values[i]) if i < len(values) else None
    return losses


# ---------------------------------------------------------------- pairs from the model's own samples
PAIR_COLUMNS = ["id", "source", "prompt", "completion", "rejected", "answer"]
REWARD_PAIR_COLUMNS = PAIR_COLUMNS + ["chosen_reward", "rejected_reward"]


def pairs_from_rewards(model, tokenizer, formatted: pd.DataFrame, params: PreferenceParams, rewards, mesh,
                       max_prompts: int) -> tuple[pd.DataFrame, dict]:
    """(pairs, counts): `k` samples per prompt with evaluation's sampler, scored with GRPO's rewards; per prompt
    the best and the worst sample, kept where their weighted total rewards differ by at least `margin`.

    A sample that stopped by itself gets the end-of-turn marker SFT taught (one cut off at
    `max_new_tokens` does not), so a pair's answers read as the training data's do.
    """
    from tunix_pipeline.config import EvaluateParams
    from tunix_pipeline.evaluation import Generator
    from tunix_pipeline.formatting import end_of_turn
    from tunix_pipeline.grpo import REWARD_COLUMNS, fitting_prompts

    spec = params.from_rewards
    rows, too_long = fitting_prompts(formatted.head(max_prompts), tokenizer, params.max_prompt_length)
    counts = {"prompts": len(rows), "prompts_too_long": too_long, "samples": len(rows) * spec.num_samples}
    if not len(rows):
        return pd.DataFrame(columns=REWARD_PAIR_COLUMNS), {**counts, "pairs": 0, "below_margin": 0}
    sampling = EvaluateParams(
        num_prompts=len(rows), max_new_tokens=spec.max_new_tokens, batch_size=spec.batch_size,
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, num_samples=spec.num_samples, seed=spec.seed,
    )
    with mesh:
        texts, lengths = Generator(model, tokenizer, sampling, params.max_prompt_length)(rows["prompt"].tolist())
    closing = end_of_turn(tokenizer)
    k = spec.num_samples
    completions = [t + closing if n < spec.max_new_tokens else t for t, n in zip(texts, lengths)]
    columns = {key: np.repeat(rows[column].astype(str).to_numpy(), k) for key, column in REWARD_COLUMNS.items()
               if column in rows}
    total = rewards.score(np.repeat(rows["prompt"].to_numpy(), k), texts, **columns)["total"].reshape(-1, k)
    best, worst = total.argmax(axis=1), total.argmin(axis=1)
    keep = total[np.arange(len(rows)), best] - total[np.arange(len(rows)), worst] >= max(spec.margin, 1e-9)
    out = []
    for i in np.flatnonzero(keep):
        row = rows.iloc[i]
        out.append({"id": row["id"], "source": row["source"], "prompt": row["prompt"],
                    "completion": completions[i * k + best[i]], "rejected": completions[i * k + worst[i]],
                    "answer": row["answer"], "chosen_reward": float(total[i, best[i]]),
                    "rejected_reward": float(total[i, worst[i]])})
    counts.update(pairs=len(out), below_margin=int((~keep).sum()), mean_reward=float(total.mean()))
    return pd.DataFrame(out, columns=REWARD_PAIR_COLUMNS), counts
