"""The training stages and what they share: the loop, the loss, the optimizer, checkpoints; SFT, preference and
its pairs, GRPO, rewards and the judge."""
