"""Tunix's RL learners, chosen by name (`grpo.loss_variant`), as Tunix's own `function_registry` chooses losses."""

from tunix.rl.grpo import dapo_learner, drgrpo_learner, grpo_learner

from tunix_pipeline import upstream
from tunix_pipeline.config import GrpoParams


def algorithm(params: GrpoParams):
    """(Tunix algorithm config, learner class) for `grpo.loss_variant`."""
    common = dict(num_generations=params.num_generations, num_iterations=params.num_iterations, epsilon=params.epsilon)
    if params.loss_variant == "grpo":
        return grpo_learner.GRPOConfig(beta=params.beta, **common), grpo_learner.GRPOLearner
    if params.loss_variant == "dr-grpo":
        return drgrpo_learner.DrGRPOConfig(beta=params.beta, **common), drgrpo_learner.DrGRPOLearner
    epsilon_high = params.epsilon_high if params.epsilon_high is not None else 0.28
    config = upstream.dapo_config(epsilon_high, **common)
    return config, dapo_learner.DAPOLearner
