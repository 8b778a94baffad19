"""The optimizer of every training stage (SFT, preference, GRPO), from the `OptimizerSettings` keys each
stage's section has (`sft.learning_rate`, `grpo.weight_decay`, ...): a change to the optimizer (the schedule,
what decays) is made here once."""

from __future__ import annotations

import jax
import optax

from tunix_pipeline.config import OptimizerSettings


def learning_rate_schedule(opt: OptimizerSettings, max_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine (to 10% of the peak), linear (to 0) or constant, over `max_steps`."""
    warmup = optax.linear_schedule(0.0, opt.learning_rate, opt.warmup_steps)
    rest = max_steps - opt.warmup_steps
    if opt.schedule == "cosine":
        after = optax.cosine_decay_schedule(opt.learning_rate, rest, alpha=0.1)
    elif opt.schedule == "linear":
        after = optax.linear_schedule(opt.learning_rate, 0.0, rest)
    else:
        after = optax.constant_schedule(opt.learning_rate)
    return optax.join_schedules([warmup, after], [opt.warmup_steps]) if opt.warmup_steps else after


def decay_mask(params):
    """Weight decay on matrices only: not on norms, biases or other vectors."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(opt: OptimizerSettings, max_steps: int) -> optax.GradientTransformation:
    def build(learning_rate):
        if opt.optimizer == "adamw":
            core = optax.adamw(learning_rate, weight_decay=opt.weight_decay, mask=decay_mask, mu_dtype=opt.mu_dtype)
        else:
            core = optax.adafactor(learning_rate, weight_decay_rate=opt.weight_decay or None, weight_decay_mask=decay_mask)
        if opt.max_grad_norm is None:
            return core
        return optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), core)

    # inject_hyperparams lets Tunix read and log the learning rate every step
    return optax.inject_hyperparams(build)(learning_rate=learning_rate_schedule(opt, max_steps))
