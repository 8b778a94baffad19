"""tunix_pipeline: fine-tune open LLMs for reasoning on JAX with Tunix, as a Kedro DAG."""

__version__ = "0.1.0"
