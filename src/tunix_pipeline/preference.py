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

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from tunix_pipeline.config import PreferenceParams
from tunix_pipeline.errors import UserError

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


def loss_fn(model, train_example, *, params: PreferenceParams):
    """Tunix loss hook: the configured method's mean loss and the metrics `DPOTrainer` logs."""
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
