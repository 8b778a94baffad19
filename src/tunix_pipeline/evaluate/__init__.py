"""Scoring a policy: generation, accuracy and its statistics, the dev split during training, lm-evaluation-harness."""
