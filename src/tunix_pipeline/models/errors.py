class ModelError(ValueError):
    """A model folder, id or setting that cannot be used; the message says how to fix it."""
