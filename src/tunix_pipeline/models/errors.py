from tunix_pipeline.run.errors import UserError


class ModelError(UserError, ValueError):
    """A model folder, id or setting that cannot be used; the message says how to fix it."""
