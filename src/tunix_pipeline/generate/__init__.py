"""Prompts to completions with a policy: the sampler every stage and the evaluation share (continuous batching,
per-row stops, progress)."""
