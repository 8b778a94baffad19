"""Scoring a policy: accuracy and its statistics, the dev split during training, policies side by side,
lm-evaluation-harness."""
