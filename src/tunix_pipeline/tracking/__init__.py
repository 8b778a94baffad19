"""MLflow: the run, its parameters and outputs, per-step metrics, the model registry."""
