"""The project's pipelines, one package per stage.

The names of the nodes that code outside their pipeline looks for (the hooks, runtime's Orbax folders):
defined here once, used by the pipelines that create the nodes and by the code that finds them.
"""

TRAIN_SFT = "train_sft"
RUN_PREFERENCE = "run_preference"
RUN_GRPO = "run_grpo"
TRAINING_NODES = frozenset({TRAIN_SFT, RUN_PREFERENCE, RUN_GRPO})
